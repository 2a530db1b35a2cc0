"""The device backends on the CPU. The HPU backend's own tests, against a stand-in for Habana's
bridge, are in test_hpu.py."""

from __future__ import annotations

import pytest
import torch

from bloom_hpu.runtime.backends import Backend, DeviceError, make_backend
from bloom_hpu.loading import load_model
from bloom_hpu.runtime.steps import StepRunner
from generation.generator import Generator


def generator_on(backend_factory, folder) -> Generator:
    model, _ = load_model(folder, device="cpu")
    tokenizer = Generator.from_pretrained(folder).tokenizer
    return Generator(model, tokenizer, StepRunner(model, backend_factory()), folder)


def test_unavailable_devices_are_clear_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="no CUDA device"):
        make_backend("cuda")
    with pytest.raises(DeviceError, match="Habana"):
        make_backend("hpu")
    with pytest.raises(DeviceError, match="unknown device"):
        make_backend("tpu")
    assert make_backend(None).device.type in ("cpu", "cuda")


def test_compiled_cpu_decode_step_gives_the_same_tokens(tiny_checkpoint):
    eager = generator_on(lambda: Backend("cpu"), tiny_checkpoint)
    compiled = generator_on(lambda: Backend("cpu", compile_steps=True), tiny_checkpoint)
    prompts = ["It was the best of times", "Hello there"]
    assert [r.token_ids for r in compiled.generate(prompts, max_length=16)] == \
        [r.token_ids for r in eager.generate(prompts, max_length=16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_stops_at_the_longest_prompt_with_the_same_results(dtype):
    """Static shapes pad prompts to P for graph capture; on CPU the prefill runs over the real
    slots only, and the logits, the real slots of the cache and the decode steps after it are
    those of the full padded prefill. The step is still called with its static [B, P]."""
    from bloom_hpu.config import BloomConfig
    from bloom_hpu.model import StaticBloom
    from utils.random_checkpoint import random_weights

    config = BloomConfig(vocab_size=1024, hidden_size=64, n_layer=2, n_head=4)
    model = StaticBloom(config)
    model.load_state_dict(random_weights(config, live_vocab=1000, seed=3, weight_scale=1.0))
    model = model.to(dtype).eval().requires_grad_(False)
    backend = Backend("cpu")
    assert backend.trim_prefill
    runner = StepRunner(model, backend)
    # Padded to 24, longest 20: 60 and 72 rows, which take the same product path on every CPU (AMX
    # tiles up to 80 rows, oneDNN past 16 elsewhere), as bf16's exact comparison below needs.
    ids, lengths = torch.randint(4, 1000, (3, 24)), torch.tensor([20, 7, 13])
    positions_seen = []
    embed = model.embed
    model.embed = lambda t: positions_seen.append(t.shape[1]) or embed(t)
    trimmed, full = model.allocate_cache(3, 40), model.allocate_cache(3, 40)
    ours = runner.prefill(ids, lengths, trimmed)
    backend.trim_prefill = False
    reference = runner.prefill(ids, lengths, full)
    assert positions_seen == [20, 24]
    assert {s[1] for s in backend.signatures_of("prefill")} == {(((3, 24), "torch.int64"), ((3,), "torch.int64"))}
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(ours, reference, **tolerance)
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(trimmed.keys[:, row, :, :length], full.keys[:, row, :, :length], **tolerance)
        torch.testing.assert_close(trimmed.values[:, row, :, :length], full.values[:, row, :, :length], **tolerance)
    tokens, positions = reference.argmax(-1)[:, None], lengths.clone()
    for _ in range(3):
        a, b = runner.decode(tokens, positions, trimmed, 40), runner.decode(tokens, positions, full, 40)
        torch.testing.assert_close(a, b, **tolerance)
        tokens, positions = b.argmax(-1)[:, None], positions + 1
