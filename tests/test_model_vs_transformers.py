"""Our StaticBloom against transformers' BloomForCausalLM on the same random weights."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from bloom_hpu.alibi import alibi_slopes
from bloom_hpu.runtime.backends import make_backend
from bloom_hpu.loading import load_model
from bloom_hpu.runtime.steps import StepRunner
from utils.random_checkpoint import make_random_checkpoint

CONFIGS = [  # (n_head, hidden_size, n_layer): powers of two and not (12, 14)
    (4, 64, 2),
    (12, 96, 3),
    (14, 112, 2),
    (16, 256, 4),
]


@pytest.mark.parametrize("n_head", [1, 2, 4, 8, 12, 14, 16, 32, 112])
def test_alibi_slopes_match_transformers(n_head):
    mask = torch.ones(1, 5, dtype=torch.long)
    theirs = build_alibi_tensor(mask, n_head, torch.float32)[:, 0, 1]  # slope * position 1
    assert torch.equal(alibi_slopes(n_head), theirs)


def right_padded(rows: list[list[int]], length: int, pad: int = 3):
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids, torch.tensor([len(r) for r in rows])


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"heads{c[0]}-hidden{c[1]}-layers{c[2]}")
def checkpoint(request, tmp_path_factory):
    n_head, hidden, layers = request.param
    folder = tmp_path_factory.mktemp(f"ckpt{n_head}")
    return make_random_checkpoint(folder, hidden_size=hidden, n_layer=layers, n_head=n_head, seed=n_head)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, None), (torch.float16, None)])
def test_prefill_and_decode_logits_match(checkpoint, dtype, atol):
    reference = transformers.BloomForCausalLM.from_pretrained(checkpoint, torch_dtype=dtype).eval()
    model, _ = load_model(checkpoint, dtype=dtype)
    runner = StepRunner(model, make_backend("cpu"))
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 1000, (n,), generator=gen).tolist() for n in (9, 4, 1)]
    ids, lengths = right_padded(rows, 16)
    cache = runner.cache(3, 16)
    ours = runner.prefill(ids, lengths, cache).float()
    nxt = ours.argmax(-1)
    ours_next = runner.decode(nxt[:, None], lengths.clone(), cache, 16).float()
    with torch.no_grad():
        for b, row in enumerate(rows):
            ref = reference(torch.tensor([row])).logits[0, -1].float()
            ref_next = reference(torch.tensor([row + [int(nxt[b])]])).logits[0, -1].float()
            if atol is not None:
                torch.testing.assert_close(ours[b], ref, atol=atol, rtol=1e-4)
                torch.testing.assert_close(ours_next[b], ref_next, atol=atol, rtol=1e-4)
            else:
                # bf16, fp16: rounding differs in places; demand agreement relative to the logit scale,
                # and that our top token is also (near-)top for transformers.
                scale = ref.abs().max()
                assert (ours[b] - ref).abs().max() < 0.05 * scale
                assert (ours_next[b] - ref_next).abs().max() < 0.05 * scale
                assert ref[ours[b].argmax()] >= ref.max() - 0.05 * scale


def test_full_logits_match_every_position(tmp_path):
    folder = make_random_checkpoint(tmp_path, hidden_size=64, n_layer=2, n_head=4, seed=3)
    reference = transformers.BloomForCausalLM.from_pretrained(folder).eval()
    model, _ = load_model(folder)
    rows = [[10, 11, 12, 13, 14, 15], [20, 21, 22]]
    ids, lengths = right_padded(rows, 8)
    ours = model.full_logits(ids, lengths, model.allocate_cache(2, 8))
    with torch.no_grad():
        for b, row in enumerate(rows):
            ref = reference(torch.tensor([row])).logits[0]
            torch.testing.assert_close(ours[b, : len(row)], ref, atol=1e-4, rtol=1e-4)


def test_kv_cache_bytes_and_in_place_writes(tmp_path):
    folder = make_random_checkpoint(tmp_path, hidden_size=64, n_layer=2, n_head=4, seed=4)
    model, _ = load_model(folder, dtype=torch.bfloat16)
    runner = StepRunner(model, make_backend("cpu"))
    cache = runner.cache(2, 16)
    assert runner.cache(2, 16) is cache  # one allocation per shape, reused
    cfg = model.config
    assert cache.nbytes == cfg.n_layer * 2 * 2 * cfg.n_head * 16 * cfg.head_dim * 2
    storage = cache.keys.data_ptr()
    ids, lengths = right_padded([[5, 6, 7], [8]], 16)
    runner.prefill(ids, lengths, cache)
    runner.decode(torch.tensor([[9], [9]]), lengths.clone(), cache, 16)
    assert cache.keys.data_ptr() == storage
    # Each row's new token went to its own slot (3 and 1): the same keys/values a prefill of the
    # longer prompts writes there.
    reference = runner.cache(2, 8)
    ids2, lengths2 = right_padded([[5, 6, 7, 9], [8, 9]], 8)
    runner.prefill(ids2, lengths2, reference)
    for row, slot in ((0, 3), (1, 1)):
        torch.testing.assert_close(cache.keys[:, row, :, slot], reference.keys[:, row, :, slot])
        torch.testing.assert_close(cache.values[:, row, :, slot], reference.values[:, row, :, slot])
