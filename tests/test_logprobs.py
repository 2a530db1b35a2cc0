"""Log-probabilities against transformers on the same random weights, and token text pieces."""

from __future__ import annotations

import random

import pytest
import torch

from generation.run.logprobs import TokenText, offsets_of, score_rows

PROMPTS = ["Hello world", "The cat sat on the mat and then", "A"]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[n, V] log_softmax of transformers' logits for one unpadded row."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_generated_token_logprobs_match_transformers(scoring_setup):
    _, gen, hf = scoring_setup
    results = gen.generate(PROMPTS, max_length=24, logprobs=True)
    for r in results:
        ids = r.prompt_token_ids + r.token_ids
        ref = hf_logprobs(hf, ids)
        n = len(r.prompt_token_ids)
        expected = [ref[n - 1 + i, t].item() for i, t in enumerate(r.token_ids)]
        got = r.sequences[0].token_logprobs
        assert len(got) == len(r.token_ids) > 0
        assert got == pytest.approx(expected, abs=1e-4)
        # Greedy tokens are the argmax: their log-prob is the row maximum.
        assert all(ref[n - 1 + i].max().item() == pytest.approx(lp, abs=1e-4) for i, lp in enumerate(got))


def test_score_rows_top_k_and_echo_positions_match_transformers(scoring_setup):
    _, gen, hf = scoring_setup
    rows = [gen.tokenizer.encode(p) for p in PROMPTS]
    rows[2] = rows[2] + rows[0]  # mixed lengths in one padded pass
    scores = score_rows(gen.runner, rows, top_k=3, length=32, pad_token_id=gen.tokenizer.pad_token_id)
    for row, s in zip(rows, scores):
        ref = hf_logprobs(hf, row)
        assert len(s.token_logprobs) == len(row) - 1
        for t in range(1, len(row)):
            assert s.token_logprobs[t - 1] == pytest.approx(ref[t - 1, row[t]].item(), abs=1e-4)
            vals, idx = ref[t - 1].topk(3)
            assert s.top_ids[t - 1] == idx.tolist()
            assert s.top_logprobs[t - 1] == pytest.approx(vals.tolist(), abs=1e-4)
            assert s.greedy[t - 1] == (idx[0].item() == row[t])


def test_scoring_on_cpu_stops_at_the_longest_row_with_the_same_scores(scoring_setup):
    """A pass padded to 64 computes the longest row's positions only (CPU: ``Backend.trim_prefill``), and
    scores exactly what the full padded pass scores. Rows of one token have nothing to score."""
    _, gen, _ = scoring_setup
    model = gen.runner.model
    rows = [gen.tokenizer.encode(p) for p in PROMPTS[:2]]
    widths = []
    embed = model.embed
    model.embed = lambda t: widths.append(t.shape[1]) or embed(t)
    try:
        assert gen.backend.trim_prefill
        trimmed = score_rows(gen.runner, rows, top_k=2, length=64)
        gen.backend.trim_prefill = False
        full = score_rows(gen.runner, rows, top_k=2, length=64)
    finally:
        gen.backend.trim_prefill = True
        del model.embed
    assert widths == [max(len(r) for r in rows), 64]
    for a, b in zip(trimmed, full):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, rel=1e-5, abs=1e-5) and a.top_ids == b.top_ids
    assert [s.token_logprobs for s in score_rows(gen.runner, [[5], [7]])] == [[], []]


def test_token_pieces_join_to_the_decoded_text_and_offsets_index_it(scoring_setup):
    _, gen, _ = scoring_setup
    text_of = TokenText(gen.tokenizer)
    rng = random.Random(0)
    samples = [gen.tokenizer.encode("héllo 日本語 wörld, ünïcode ✓ end")]
    # Random ids split multi-byte characters between tokens and include special tokens (EOS, pad).
    samples += [[rng.randrange(gen.tokenizer.vocab_size) for _ in range(30)] for _ in range(20)]
    for ids in samples:
        pieces = text_of.pieces(ids)
        text = gen.tokenizer.decode(ids)
        assert len(pieces) == len(ids)
        assert "".join(pieces) == text
        for piece, offset in zip(pieces, offsets_of(pieces)):
            assert text[offset : offset + len(piece)] == piece
