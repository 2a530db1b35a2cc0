"""transformers' sampling distribution of a row's next tokens, and the chi-square test that a
sampler's draws follow it: the reference of the tests that speculation keeps the target's
distribution exactly (prompt lookup: tests/test_speculation.py; a draft model:
tests/test_speculation_draft.py)."""

from __future__ import annotations

import torch
import transformers

SAMPLING = dict(do_sample=True, temperature=1.5, top_k=4, ignore_eos=True)


def hf_next(model, ids: list[int]) -> torch.Tensor:
    """transformers' processed next-token distribution [V] after ``ids`` (SAMPLING's temperature, top-k)."""
    config = transformers.GenerationConfig(do_sample=True, temperature=SAMPLING["temperature"], top_k=SAMPLING["top_k"])
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=len(ids), device="cpu")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids).logits[:, -1].float()
    return processors(input_ids, logits).softmax(-1)[0]


def second_and_third(model, ids: list[int]) -> tuple[int, torch.Tensor, dict[tuple[int, int], float]]:
    """After ``ids``: the likeliest first token t0, p(t1 | t0) [V], and the exact joint
    p(t1 | t0) p(t2 | t0, t1) of every pair top-k keeps."""
    t0 = int(hf_next(model, ids).argmax())
    p1 = hf_next(model, ids + [t0])
    joint = {}
    for t1 in p1.nonzero()[:, 0].tolist():
        p2 = hf_next(model, ids + [t0, t1])
        for t2 in p2.nonzero()[:, 0].tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return t0, p1, joint


def assert_pairs_follow(sequences, t0: int, joint: dict[tuple[int, int], float]) -> None:
    """The (t1, t2) of the sampled sequences that began with t0 follow ``joint``: nothing outside it,
    and a chi-square over the cells expected at least 5 times (the rest pooled) within five
    standard deviations of its degrees of freedom."""
    pairs = [tuple(s.token_ids[1:3]) for s in sequences if s.token_ids[0] == t0]
    assert len(pairs) > 1000
    counts: dict[tuple, int] = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    assert set(counts) <= set(joint)  # nothing outside what top-k keeps
    n = len(pairs)
    big = [cell for cell, p in joint.items() if p * n >= 5]
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [joint[c] * n for c in big] + [n - sum(joint[c] * n for c in big)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len([e for e in exp if e > 0]) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
