"""Sampling: the right distribution (transformers' processors, in transformers' order), seeded
reproducibility that does not depend on batch companions, per-row EOS, and no per-token sync."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from generation.search import processors as procs
from generation.search.sampling import row_keys, uniform
from generation.search.state import LoopState
from isas import KERNEL_ISAS

EOS = 2
PROMPTS = ["It was the best of times", "a", "The quick brown fox jumps over", "Hello, world"]


def test_uniform_noise_is_uniform_and_keyed():
    keys = torch.tensor([0, 1, 12345, 2**31 - 2])
    u = uniform(keys, step=3, n=20000)
    assert ((u > 0) & (u < 1)).all()
    for row in u:  # each row looks uniform: mean, spread and deciles
        assert abs(row.mean().item() - 0.5) < 0.01 and abs(row.var().item() - 1 / 12) < 0.005
        counts = torch.histc(row, bins=10, min=0, max=1)
        assert (counts - 2000).abs().max() < 200
    assert torch.equal(u, uniform(keys, step=3, n=20000))  # a pure function of (key, step, column)
    assert not torch.equal(u, uniform(keys, step=4, n=20000))
    assert torch.corrcoef(u)[0, 1:].abs().max() < 0.03  # rows (keys) are independent


def test_row_keys_depend_on_the_row_not_on_the_batch():
    a, b = [5, 6, 7], [8]
    alone = row_keys([a], seed=1, copies=2, device="cpu")
    mixed = row_keys([b, a, a], seed=1, copies=2, device="cpu")
    assert mixed[2:4].tolist() == alone.tolist()  # the first "a" wherever it sits
    assert len(set(mixed.tolist())) == 6  # copies and repeated prompts differ
    assert row_keys([a], seed=2, copies=2, device="cpu").tolist() != alone.tolist()


OPTIONS = dict(temperature=5.0, top_k=40, top_p=0.8, repetition_penalty=1.3)


def hf_probabilities(eos_reference, ids, **options):
    """transformers' next-token distribution: its own processor list on its own logits."""
    config = GenerationConfig(do_sample=True, eos_token_id=EOS, **options)
    config._eos_token_tensor = torch.tensor([EOS])
    processors = eos_reference._get_logits_processor(generation_config=config, input_ids_seq_length=len(ids),
                                                 device="cpu")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = eos_reference(input_ids).logits[:, -1].float()
    return processors(input_ids, logits).softmax(-1)[0], logits, input_ids


def test_sampled_distribution_matches_transformers(eos_generator, eos_reference):
    """Empirical next-token frequencies over many seeded draws match transformers' probabilities;
    the same processors in another order (top-p before temperature) give a distribution this test
    tells apart."""
    prompt = PROMPTS[0]
    ids = eos_generator.tokenizer.encode(prompt)
    expected, logits, input_ids = hf_probabilities(eos_reference, ids, **OPTIONS)
    state = LoopState(input_ids, torch.tensor([len(ids)]), torch.tensor([len(ids)]), step=0)
    wrong = procs.repetition_penalty(logits, state.sequence, state.positions, OPTIONS["repetition_penalty"])
    wrong = procs.top_p(procs.top_k(wrong, OPTIONS["top_k"], 1), OPTIONS["top_p"], 1)
    wrong = procs.temperature(wrong, OPTIONS["temperature"]).softmax(-1)[0]
    assert 0.5 * (wrong - expected).abs().sum() > 0.3
    assert (expected > 0.02).sum() >= 8  # a spread distribution, not one dominant token

    draws = 4000
    result = eos_generator.generate(prompt, max_new_tokens=1, max_length=16, do_sample=True, seed=123,
                                num_return_sequences=draws, **OPTIONS)[0]
    first = torch.tensor([s.token_ids[0] for s in result.sequences])
    empirical = torch.bincount(first, minlength=expected.numel()).float() / draws
    assert empirical[expected == 0].sum() == 0  # nothing outside the kept set
    assert 0.5 * (empirical - expected).abs().sum() < 0.05  # sampling noise: ~0.02
    # Chi-square over the tokens transformers keeps (expected count >= 5 each; rarer ones pooled).
    big = expected * draws >= 5
    obs = torch.cat([empirical[big] * draws, (empirical[~big] * draws).sum()[None]])
    exp = torch.cat([expected[big] * draws, (expected[~big] * draws).sum()[None]])
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5  # far beyond any plausible fluctuation


def test_same_seed_same_output_and_batch_independence(eos_generator):
    options = dict(max_length=24, do_sample=True, temperature=2.0, top_p=0.9, no_repeat_ngram_size=2)
    first = eos_generator.generate(PROMPTS, seed=7, **options)
    again = eos_generator.generate(PROMPTS, seed=7, **options)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    other = eos_generator.generate(PROMPTS, seed=8, **options)
    assert [r.token_ids for r in first] != [r.token_ids for r in other]
    # Each prompt alone, or in another batch at another place, samples the same text.
    for prompt, result in zip(PROMPTS, first):
        assert eos_generator.generate(prompt, seed=7, **options)[0].token_ids == result.token_ids
    shuffled = eos_generator.generate(PROMPTS[::-1] + ["something else entirely"], seed=7, **options)
    assert [r.token_ids for r in shuffled[:4]] == [r.token_ids for r in first[::-1]]


def test_seedless_runs_follow_torch_manual_seed(eos_generator):
    options = dict(max_length=16, do_sample=True, temperature=2.0)
    torch.manual_seed(0)
    a = eos_generator.generate(PROMPTS, **options)
    torch.manual_seed(0)
    b = eos_generator.generate(PROMPTS, **options)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_num_return_sequences_and_per_row_eos(eos_generator):
    results = eos_generator.generate(PROMPTS, max_length=24, do_sample=True, seed=3, temperature=1.5,
                                 num_return_sequences=6, ignore_eos=False)
    sequences = [s for r in results for s in r.sequences]
    assert all(len(r.sequences) == 6 for r in results)
    assert len({tuple(s.token_ids) for s in results[0].sequences}) > 1  # copies sample independently
    for result in results:
        room = 24 - len(result.prompt_token_ids)
        for s in result.sequences:
            if s.finish_reason == "eos":  # stopped at its own EOS, nothing after it
                assert s.token_ids[-1] == EOS and EOS not in s.token_ids[:-1]
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == room and EOS not in s.token_ids
    reasons = {s.finish_reason for s in sequences}
    assert reasons == {"eos", "length"}


def test_min_new_tokens_holds_back_eos_when_sampling(eos_generator):
    results = eos_generator.generate(PROMPTS, max_length=24, do_sample=True, seed=3, temperature=1.5,
                                 num_return_sequences=6, ignore_eos=False, min_new_tokens=6)
    for s in (s for r in results for s in r.sequences):
        assert EOS not in s.token_ids[:6]


def test_sampling_loop_has_no_per_token_sync(eos_generator, monkeypatch):
    reads = []
    for name in ("__bool__", "item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    eos_generator.generate(PROMPTS, max_length=28, do_sample=True, seed=1, ignore_eos=False, min_new_tokens=20,
                       repetition_penalty=1.2, no_repeat_ngram_size=2, top_k=50, top_p=0.9, temperature=1.3)
    monkeypatch.undo()
    # ~27 steps: the batched done-check every 8 steps, plus the final copies of the results.
    assert len(reads) <= 27 // 8 + 6


def test_cpu_sampling_uses_the_kernel_noise_with_the_same_tokens(eos_generator):
    """Where the CPU kernels are loaded, sampled search (plain and beam sampling) draws its noise with
    them, and samples exactly the tokens of the noise made op by op."""
    if not KERNEL_ISAS:
        pytest.skip("no CPU kernel build runs here (another architecture, or no compiler)")
    assert eos_generator.backend.cpu_plan.kernels is not None  # where a build runs, the default path loads it
    assert eos_generator.noise_kernel is not None
    runs = [dict(max_length=24, do_sample=True, temperature=1.5, seed=11, num_return_sequences=3),
            dict(max_length=20, do_sample=True, num_beams=3, seed=5, num_return_sequences=2)]
    with_kernel = [eos_generator.generate(PROMPTS, **options) for options in runs]
    eos_generator.noise_kernel = None  # the cached property's value, for this test only
    try:
        op_by_op = [eos_generator.generate(PROMPTS, **options) for options in runs]
    finally:
        del eos_generator.noise_kernel
    for ours, reference in zip(with_kernel, op_by_op):
        assert [[s.token_ids for s in r.sequences] for r in ours] == [[s.token_ids for s in r.sequences] for r in reference]


def test_uniform_never_reaches_zero_or_one():
    """The extreme hash values map strictly inside (0, 1): Gumbel noise stays finite."""
    from generation.search import sampling

    top = torch.tensor([(1 << 31) - 1, 0])
    assert ((top >> 8).float() + 0.5).mul(1.0 / (1 << 23)).lt(1).all()
    u = uniform(torch.arange(64), step=0, n=1 << 14)
    assert torch.isfinite(sampling.gumbel(torch.arange(64), 0, 1 << 14)).all() and (u < 1).all() and (u > 0).all()
