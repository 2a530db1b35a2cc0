"""Beam search against transformers' ``generate(num_beams=...)`` on random weights.

Every prompt of a mixed-length batch is compared with transformers run on that prompt alone: the
same finished hypotheses, best first, and the same ``sequences_scores``. The checkpoint's EOS is
made likely (see ``eos_checkpoint``) so hypotheses really end at EOS.
"""

from __future__ import annotations

import pytest
import torch

from generation.search.beam import beam_search
from generation.search.processors import LogitsProcessors

EOS = 2
PROMPTS = ["It was the best of times", "a", "The quick brown fox jumps over", "Hello, world"]
MAX_LENGTH = 20


def hf_beams(eos_reference, ids, new_tokens, ignore_eos, **options):
    """transformers' hypotheses for one prompt: (generated ids, score) best first."""
    with torch.no_grad():
        out = eos_reference.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens, pad_token_id=3, eos_token_id=None if ignore_eos else EOS,
            output_scores=True, return_dict_in_generate=True, **options,
        )
    hypotheses = []
    for row, score in zip(out.sequences[:, len(ids):].tolist(), out.sequences_scores.tolist()):
        # A hypothesis ends at its EOS (then transformers pads); ours keep ids up to that EOS.
        hypotheses.append((row[: row.index(EOS) + 1] if EOS in row else row, score))
    return hypotheses


CASES = [  # num_beams, length_penalty, early_stopping, num_return_sequences, ignore_eos
    (2, 1.0, False, 1, True),
    (3, 0.5, True, 2, False),
    (4, 2.0, False, 4, False),
    (5, 1.0, "never", 3, False),
    (6, 1.5, "never", 2, True),
    (8, 0.7, True, 2, True),
    (8, 1.2, False, 8, False),
    (3, 1.0, False, 3, False),
]


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping,num_return,ignore_eos", CASES)
def test_beam_matches_transformers(eos_generator, eos_reference, num_beams, length_penalty, early_stopping,
                                   num_return, ignore_eos):
    options = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
                   num_return_sequences=num_return)
    results = eos_generator.generate(PROMPTS, max_length=MAX_LENGTH, ignore_eos=ignore_eos, **options)
    for prompt, result in zip(PROMPTS, results):
        ids = eos_generator.tokenizer.encode(prompt)
        expected = hf_beams(eos_reference, ids, MAX_LENGTH - len(ids), ignore_eos, **options)
        assert len(result.sequences) == num_return
        for ours, (tokens, score) in zip(result.sequences, expected):
            assert ours.token_ids == tokens, prompt
            assert ours.score == pytest.approx(score, abs=1e-4), prompt
            assert ours.finish_reason == ("eos" if tokens[-1] == EOS else "length")


def test_cases_exercise_eos(eos_generator):
    """The comparisons above are meaningful: some hypotheses end at EOS, and not all of them."""
    results = eos_generator.generate(PROMPTS, max_length=MAX_LENGTH, ignore_eos=False, num_beams=4,
                                 num_return_sequences=4)
    reasons = [s.finish_reason for r in results for s in r.sequences]
    assert "eos" in reasons and "length" in reasons


def test_batch_rows_equal_rows_alone(eos_generator):
    """Padding rows and companions change nothing: each prompt's beams equal that prompt alone,
    also when the prompts have different budgets (max_new_tokens below some rows' room)."""
    options = dict(num_beams=4, num_return_sequences=3, ignore_eos=False, length_penalty=0.8, max_new_tokens=9)
    together = eos_generator.generate(PROMPTS, max_length=MAX_LENGTH, **options)
    for prompt, result in zip(PROMPTS, together):
        alone = eos_generator.generate([prompt], max_length=MAX_LENGTH, **options)[0]
        assert [s.token_ids for s in result.sequences] == [s.token_ids for s in alone.sequences]
        assert [s.score for s in result.sequences] == pytest.approx([s.score for s in alone.sequences], abs=1e-5)


def test_rows_with_one_token_budget(eos_generator, eos_reference):
    """The longest prompt leaves room for a single token while the others run on."""
    longest = max(len(eos_generator.tokenizer.encode(p)) for p in PROMPTS)
    results = eos_generator.generate(PROMPTS, max_length=longest + 1, num_beams=3, ignore_eos=False)
    for prompt, result in zip(PROMPTS, results):
        ids = eos_generator.tokenizer.encode(prompt)
        tokens, score = hf_beams(eos_reference, ids, longest + 1 - len(ids), False, num_beams=3)[0]
        assert result.token_ids == tokens and result.sequences[0].score == pytest.approx(score, abs=1e-4)


def test_beam_processors_match_transformers(eos_generator, eos_reference):
    options = dict(num_beams=3, repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=4)
    results = eos_generator.generate(PROMPTS, max_length=MAX_LENGTH, ignore_eos=False, **options)
    for prompt, result in zip(PROMPTS, results):
        ids = eos_generator.tokenizer.encode(prompt)
        tokens, score = hf_beams(eos_reference, ids, MAX_LENGTH - len(ids), False, **options)[0]
        assert result.token_ids == tokens and result.sequences[0].score == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("shapes", [dict(use_kv_cache=False), dict(static_shapes=False), dict(bucket_width=4)])
def test_beam_results_do_not_depend_on_the_shape_recipe(eos_generator, shapes):
    options = dict(num_beams=3, num_return_sequences=2, ignore_eos=False)
    cached = eos_generator.generate(PROMPTS, max_length=16, **options)
    recomputed = eos_generator.generate(PROMPTS, max_length=16, **shapes, **options)
    for a, b in zip(cached, recomputed):
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]


def test_beam_loop_stays_on_device(eos_generator, monkeypatch):
    """No host round-trip per token: the loop reads a device value only in its batched done-check
    (every EOS_CHECK_EVERY steps), and runs one prefill and one decode shape for mixed lengths."""
    from generation.run.batch import make_batch
    from generation.request.options import build_options

    opts = build_options(max_length=MAX_LENGTH, num_beams=4, ignore_eos=False, early_stopping=True)
    batch = make_batch(eos_generator.tokenizer, PROMPTS, opts, eos_generator.device)
    reads = []
    for name in ("__bool__", "item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    eos_generator.backend.signatures.clear()
    out = beam_search(eos_generator.runner, batch, LogitsProcessors.from_options(opts, EOS), num_beams=4,
                      length_penalty=1.0, early_stopping=True, eos_token_id=EOS, pad_token_id=3)
    monkeypatch.undo()
    assert out.steps_run >= 8
    assert 1 <= len(reads) <= out.steps_run // 8  # (>= 1: the counting works)
    assert len(eos_generator.backend.signatures_of("prefill")) == 1
    assert len(eos_generator.backend.signatures_of("decode")) == 1


def test_beam_sampling_works(eos_generator):
    """Beam sampling (num_beams > 1 with do_sample): seeded, reproducible, best first; with a tiny
    temperature the draws follow the scores, so it finds beam search's best hypothesis."""
    first = eos_generator.generate(PROMPTS, max_length=16, num_beams=3, do_sample=True, seed=5, num_return_sequences=3)
    again = eos_generator.generate(PROMPTS, max_length=16, num_beams=3, do_sample=True, seed=5, num_return_sequences=3)
    assert [[s.token_ids for s in r.sequences] for r in first] == [[s.token_ids for s in r.sequences] for r in again]
    for result in first:
        scores = [s.score for s in result.sequences]
        assert scores == sorted(scores, reverse=True)
    cold = eos_generator.generate(PROMPTS, max_length=16, num_beams=3, do_sample=True, seed=5, temperature=0.01)
    beams = eos_generator.generate(PROMPTS, max_length=16, num_beams=3)
    for c, b in zip(cold, beams):
        assert c.token_ids == b.token_ids
        assert c.sequences[0].score * 0.01 == pytest.approx(b.sequences[0].score, rel=1e-4)
