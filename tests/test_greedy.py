"""Greedy search: identical tokens to transformers' generate, batched rows equal to rows alone,
per-row EOS, and static shapes that hold across prompt lengths."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from generation.run.batch import InputError
from generation.generator import Generator

PROMPTS = [
    "It was the best of times",
    "a",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "Hello, world",
    "Numbers 1 2 3",
]


@pytest.fixture(scope="module")
def folder(seed7_checkpoint):
    return seed7_checkpoint


@pytest.fixture(scope="module")
def reference(seed7_reference):
    return seed7_reference


@pytest.fixture(scope="module")
def generator(folder):
    return Generator.from_pretrained(folder)


def hf_greedy(reference, prompt_ids, max_length, eos_token_id=None):
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_length=max_length, do_sample=False, num_beams=1, eos_token_id=eos_token_id, pad_token_id=3,
        )
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("max_length", [None, 16, 24, 40])
def test_greedy_matches_transformers(generator, reference, max_length):
    for prompt in PROMPTS:
        ids = generator.tokenizer.encode(prompt)
        limit = max_length or len(ids) + 1  # None: the edge case max_length = prompt + 1
        if len(ids) >= limit:
            continue
        ours = generator.generate(prompt, max_length=limit)[0]
        assert ours.token_ids == hf_greedy(reference, ids, limit), prompt
        assert ours.finish_reason == "length"
        assert len(ours.token_ids) == limit - len(ids)
        assert ours.text == generator.tokenizer.decode(ours.token_ids)


def test_prompt_at_the_limit_is_refused_like_transformers(generator, reference):
    ids = generator.tokenizer.encode(PROMPTS[0])
    with pytest.raises(InputError, match=f"has {len(ids)} tokens"):
        generator.generate(PROMPTS[0], max_length=len(ids))
    with pytest.raises(ValueError):
        hf_greedy(reference, ids, len(ids))


@pytest.mark.parametrize("switches", [
    {},
    {"static_shapes": False},
    {"use_kv_cache": False},
    {"use_graphs": False},
    {"bucket_width": 8},
])
def test_batched_rows_equal_rows_alone(generator, switches):
    alone = [generator.generate(p, max_length=32, **switches)[0].token_ids for p in PROMPTS]
    together = generator.generate(PROMPTS, max_length=32, **switches)
    assert [r.token_ids for r in together] == alone
    # ...and every switch of the recipe gives the same tokens as the default recipe.
    assert alone == [generator.generate(p, max_length=32)[0].token_ids for p in PROMPTS]


def test_one_prefill_and_one_decode_signature_across_prompt_lengths(folder):
    generator = Generator.from_pretrained(folder)
    for prompt in PROMPTS:
        generator.generate(prompt, max_length=32)
    generator.generate(PROMPTS[:3], max_length=32)  # another batch size: its own shapes
    backend = generator.backend
    assert len(backend.signatures_of("prefill")) == 2
    assert len(backend.signatures_of("decode")) == 2
    batch1 = {s for s in backend.signatures if s[1][0][0][0] == 1}
    assert len(batch1) == 2  # one prefill + one decode for all five lengths at batch size 1


def test_dynamic_shapes_grow_with_the_sequence(folder):
    generator = Generator.from_pretrained(folder)
    generator.generate(PROMPTS[0], max_length=20, static_shapes=False)
    ids = generator.tokenizer.encode(PROMPTS[0])
    # Each decode step attends one more slot, so each has its own signature (the window is part
    # of it): 20 - len(ids) new tokens need that many steps minus the one the prefill produces.
    assert len(generator.backend.signatures_of("prefill")) == 1
    assert len(generator.backend.signatures_of("decode")) == 20 - len(ids) - 1


@pytest.fixture(scope="module")
def eos_folder(folder, generator, tmp_path_factory):
    """The same weights, with EOS redefined as a token that prompt 0 generates after a few steps
    but prompt 3 never generates, so rows end at different times."""
    row0 = generator.generate(PROMPTS[0], max_length=40)[0].token_ids
    row3 = generator.generate(PROMPTS[3], max_length=40)[0].token_ids
    candidates = [t for t in row0[2:] if t not in row3 and t not in row0[:2]]
    assert candidates, "the random model generated no usable EOS candidate"
    out = tmp_path_factory.mktemp("eos")
    for item in folder.iterdir():
        shutil.copy(item, out / item.name)
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = candidates[0]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_each_row_stops_at_its_own_eos(eos_folder):
    generator = Generator.from_pretrained(eos_folder)
    reference = transformers.BloomForCausalLM.from_pretrained(eos_folder).eval()
    eos = generator.tokenizer.eos_token_id
    for ignore_eos in (False, True):
        results = generator.generate(PROMPTS, max_length=40, ignore_eos=ignore_eos)
        for prompt, result in zip(PROMPTS, results):
            expected = hf_greedy(reference, generator.tokenizer.encode(prompt), 40, eos_token_id=eos)
            if eos in expected:
                expected = expected[: expected.index(eos) + 1]
            assert result.token_ids == expected
            assert result.finish_reason == ("eos" if expected[-1] == eos else "length")
    assert results[0].finish_reason == "eos" and results[3].finish_reason == "length"
    # No text after EOS is ever returned, and the EOS itself is not in the text.
    assert results[0].text == generator.tokenizer.decode(results[0].token_ids[:-1])


@pytest.mark.parametrize("vocab", [250880, 1024, 1000, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_gives_torch_argmax_indices(vocab, dtype):
    """The two-pass argmax every chooser uses gives torch's own indices: the first of tied maxima,
    NaN as the largest, rows of -inf, and views whose rows are not dense."""
    from generation.search.choose import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        scores = torch.randint(-4, 4, (6, vocab), generator=g).to(dtype)  # ties everywhere
        scores[0, -1] = 9  # the maximum in the last block
        if trial % 3 == 0:
            scores[torch.rand(scores.shape, generator=g) < 0.0005] = float("nan")
        scores[1] = float("-inf")
        scores[2, 7], scores[2, vocab // 2] = float("inf"), float("inf")
        wide = torch.cat([scores, scores], dim=1)[:, :vocab]  # row stride 2 * vocab
        for s in (scores, wide, scores[3], scores.reshape(2, 3, vocab)):
            assert torch.equal(argmax_rows(s), s.argmax(dim=-1))
