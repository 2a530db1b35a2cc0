"""Logits processors: each one equals transformers' processor, the pipeline applies them in
transformers' order, and greedy search with them gives transformers' tokens."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation import logits_process as hf

from generation.search import processors as ours
from generation.request.options import build_options
from generation.search.processors import LogitsProcessors
from generation.search.state import LoopState

EOS, PAD, VOCAB = 2, 3, 50
PROMPTS = ["It was the best of times", "a", "The quick brown fox jumps over", "Hello, world"]


def histories(lengths, seed=0, vocab=VOCAB, slots=12, extra=()):
    """Rows of different real lengths, right-padded with PAD the way our loops hold them, plus
    the exact (unpadded) rows transformers would see. Few distinct tokens: many repeats; PAD is
    one of them, so counting a pad slot as a real token would show."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 4, (n,), generator=gen) for n in lengths] + [torch.tensor(r) for r in extra]
    padded = torch.full((len(rows), slots), PAD)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    scores = torch.randn(len(rows), vocab, generator=gen) * 3
    used = torch.tensor([len(r) for r in rows])
    return rows, LoopState(padded, used, used, step=0), scores


def hf_rowwise(processor, rows, scores):
    return torch.cat([processor(r[None], s[None].clone()) for r, s in zip(rows, scores)])


@pytest.mark.parametrize("penalty", [1.5, 0.6])
def test_repetition_penalty(penalty):
    rows, state, scores = histories([5, 1, 9, 12])
    expected = hf_rowwise(hf.RepetitionPenaltyLogitsProcessor(penalty), rows, scores)
    torch.testing.assert_close(ours.repetition_penalty(scores, state.sequence, state.positions, penalty), expected)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram(n):
    # The last row ends with a repeat of its first n-gram prefixes: bans for every n.
    rows, state, scores = histories([2, 7, 11, 12, 1], seed=n, extra=[[0, 1, 2, 0, 1]])
    expected = hf_rowwise(hf.NoRepeatNGramLogitsProcessor(n), rows, scores)
    got = ours.no_repeat_ngram(scores, state, n)
    assert torch.equal(got.isinf(), expected.isinf()) and expected.isinf().any()
    torch.testing.assert_close(got, expected)


def test_min_new_tokens():
    rows, state, scores = histories([4, 6])
    for step in (0, 2, 3):
        state.step = step  # new tokens so far; transformers reads it from the row length
        hf_proc = hf.MinNewTokensLengthLogitsProcessor(4 - step, 3, EOS)  # prompt of 4 - step tokens
        expected = hf_proc(rows[0][None].expand(2, 4), scores.clone())
        torch.testing.assert_close(ours.min_new_tokens(scores, state, 3, EOS), expected)


@pytest.mark.parametrize("keep", [1, 2])
def test_warpers(keep):
    _, state, scores = histories([3, 3, 3])
    torch.testing.assert_close(ours.temperature(scores, 0.7), hf.TemperatureLogitsWarper(0.7)(None, scores))
    for k in (1, 5, VOCAB + 3):
        expected = hf.TopKLogitsWarper(k, min_tokens_to_keep=keep)(None, scores.clone())
        torch.testing.assert_close(ours.top_k(scores, k, keep), expected)
    for p in (0.05, 0.5, 0.9, 1.0):
        expected = hf.TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, scores.clone())
        torch.testing.assert_close(ours.top_p(scores, p, keep), expected)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_pipeline_order_is_transformers_order(num_beams):
    """All options on: the whole pipeline equals transformers' own processor list, applied in its
    order. (Temperature before top-p keeps a different set than after it, so order shows.)"""
    values = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5, temperature=2.5, top_k=20,
                  top_p=0.6)
    opts = build_options(do_sample=True, num_beams=num_beams, num_return_sequences=1, **values)
    pipeline = LogitsProcessors.from_options(opts, EOS)
    assert pipeline.names == ["repetition_penalty", "no_repeat_ngram", "min_new_tokens", "temperature", "top_k",
                              "top_p"]
    config = GenerationConfig(do_sample=True, num_beams=num_beams, eos_token_id=EOS, **values)
    config._eos_token_tensor = torch.tensor([EOS])
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=8, n_layer=1, n_head=1))
    rows, state, scores = histories([6, 6, 6], seed=3)
    hf_list = model._get_logits_processor(generation_config=config, input_ids_seq_length=6, device="cpu")
    expected = torch.cat([hf_list(r[None], s[None].clone()) for r, s in zip(rows, scores)])
    torch.testing.assert_close(pipeline(scores, state), expected)


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(no_repeat_ngram_size=1),
    dict(no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=3),
    dict(min_new_tokens=5, ignore_eos=False),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=3, ignore_eos=False),
])
def test_greedy_with_processors_matches_transformers(eos_generator, eos_reference, options):
    max_length = 24
    ignore_eos = options.get("ignore_eos", True)
    results = eos_generator.generate(PROMPTS, max_length=max_length, **options)
    plain = eos_generator.generate(PROMPTS, max_length=max_length, ignore_eos=ignore_eos)
    hf_options = {k: v for k, v in options.items() if k != "ignore_eos"}
    for prompt, result in zip(PROMPTS, results):
        ids = eos_generator.tokenizer.encode(prompt)
        with torch.no_grad():
            out = eos_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_length - len(ids), do_sample=False, pad_token_id=PAD,
                                     eos_token_id=None if ignore_eos else EOS, **hf_options)
        expected = out[0, len(ids):].tolist()
        expected = expected[: expected.index(EOS) + 1] if EOS in expected else expected
        assert result.token_ids == expected, prompt
    # The options did something on this model, so the comparison above tests them.
    assert any(r.token_ids != p.token_ids for r, p in zip(results, plain))


def test_per_row_top_p_keeps_what_one_value_keeps_at_the_threshold():
    """The server's per-row top_p (RowOptions' tensors) drops exactly what transformers' warper
    drops for the same p, also where the least likely token's mass lands between float32(1 - p)
    and 1 - float32(p) (the two differ in their last bits)."""
    from generation.serving.params import SamplingParams
    from generation.serving.row_options import RowOptions

    p = 0.9
    # Two tokens whose smaller probability sweeps densely across 0.1: every float32 near it.
    gap = torch.linspace(-2e-6, 2e-6, 4001, dtype=torch.float64) + math.log(9.0)
    scores = torch.stack([torch.zeros_like(gap), gap], dim=1).float()
    rows = scores.shape[0]
    opts = RowOptions(rows, 2, 4, "cpu", 0)
    for slot in range(rows):
        opts.set_row(slot, SamplingParams(temperature=1.0, top_p=p), 0, [1])
    kept = ours.top_p(scores, opts.top_p[:, None], 1, tail=opts.top_p_tail[:, None])
    expected = hf.TopPLogitsWarper(p)(None, scores.clone())
    assert (kept.isinf() != expected.isinf()).sum() == 0
    assert expected.isinf().any() and not expected.isinf().all()  # the sweep crosses the threshold


@pytest.mark.parametrize("keep", [1, 2])
def test_per_row_top_k_with_the_largest_k_known_equals_transformers(keep):
    """The server's per-row top-k: with the rows' largest k given (one top-k instead of a sort),
    each row whose k is at most it, or 0 (keep all), keeps what transformers keeps with its own k,
    ties, infinities and NaN included."""
    g = torch.Generator().manual_seed(keep)
    scores = torch.randint(-6, 6, (5, 500), generator=g).float()  # ties everywhere
    scores[1, :40] = float("-inf")
    scores[2, 7] = float("inf")
    scores[3, 11] = float("nan")
    ks = torch.tensor([3, 0, 17, 1, 40])
    for most in (40, 60):
        got = ours.top_k(scores, ks, keep, most=most)
        assert torch.equal(got.isnan(), scores.isnan())
        for row, k in enumerate(ks.tolist()):
            if k == 0:
                assert torch.equal(got[row], scores[row])
                continue
            expected = hf.TopKLogitsWarper(k, min_tokens_to_keep=keep)(None, scores[row : row + 1].clone())
            torch.testing.assert_close(got[row : row + 1], expected, equal_nan=True)
    torch.testing.assert_close(ours.top_k(scores, ks, keep, most=40), ours.top_k(scores, ks, keep), equal_nan=True)
