"""Logits processors, applied on the device in the order transformers applies them.

transformers 4.57 builds its list in ``GenerationMixin._get_logits_processor``: first the
processors that shape every search (repetition penalty, no-repeat n-grams, min new tokens), then,
only when sampling, the warpers (temperature, top-k, top-p). The order matters: top-p after a
temperature keeps a different set than top-p before it. Greedy and sampling apply the list to the raw
logits; beam search applies it to the log-softmax of the logits (as transformers does).

Every function here works on whole tensors with static shapes: [R, V] scores for R rows, the rows'
token history ``sequence`` [R, K] (prompt + generated, pad beyond each row's end) and ``used`` [R],
how many slots of each row hold real tokens. Nothing reads a value back to the host.

The option of a processor is one value for every row (a generate call) or a per-row tensor (the
server's rows, ``choose.choose_rows``, where each row is a request of its own): the same
functions serve both, so a row chooses the same token offline and served.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..request.options import GenerationOptions
from .state import LoopState

NEG_INF = float("-inf")

# (scores [R, V] float, state) -> scores [R, V]
Processor = Callable[[torch.Tensor, LoopState], torch.Tensor]


def present(sequence: torch.Tensor, used: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] bool: which tokens occur in the first ``used[r]`` slots of row r."""
    slots = torch.arange(sequence.shape[1], device=sequence.device)
    # Slots past the row's end scatter into an extra column V that is then dropped.
    index = torch.where(slots[None, :] < used[:, None], sequence, vocab)
    hits = torch.zeros(sequence.shape[0], vocab + 1, dtype=torch.bool, device=sequence.device)
    hits.scatter_(1, index, True)
    return hits[:, :vocab]


def repetition_penalty(scores: torch.Tensor, sequence: torch.Tensor, used: torch.Tensor,
                       penalty: float | torch.Tensor) -> torch.Tensor:
    """Tokens already in the row: negative scores are multiplied by ``penalty`` (a value, or [R, 1]
    per row), others divided."""
    seen = present(sequence, used, scores.shape[-1])
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def no_repeat_ngram(scores: torch.Tensor, state: LoopState, n: int) -> torch.Tensor:
    """Forbid every token that would complete an n-gram already present in the row.

    The last n-1 tokens of row r are its current prefix; each earlier start i whose n-1 tokens equal
    that prefix bans the token at i+n-1. All starts are compared at once ([R, K-n+1] windows).
    """
    seq, used = state.sequence, state.positions
    rows, length = seq.shape
    vocab = scores.shape[-1]
    if n > length:
        return scores
    if n == 1:  # every token seen so far is a repeated 1-gram
        return scores.masked_fill(present(seq, used, vocab), NEG_INF)
    windows = seq.unfold(1, n, 1)  # [R, W, n], W = K - n + 1 n-gram starts
    offsets = torch.arange(n - 1, device=seq.device)
    # (clamped: finished rows keep counting past the end of the cache)
    prefix = seq.gather(1, (used[:, None] - (n - 1) + offsets).clamp(0, length - 1))  # [R, n-1]
    match = (windows[..., : n - 1] == prefix[:, None, :]).all(dim=-1)  # [R, W]
    starts = torch.arange(windows.shape[1], device=seq.device)
    match &= starts[None, :] <= used[:, None] - n  # the whole n-gram lies in real tokens
    banned = torch.where(match, windows[..., n - 1], vocab)
    mask = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=seq.device)
    mask.scatter_(1, banned, True)
    return scores.masked_fill(mask[:, :vocab], NEG_INF)


def min_new_tokens(scores: torch.Tensor, state: LoopState, minimum: int, eos_token_id: int) -> torch.Tensor:
    if state.row_steps is not None:  # speculation: each row (verify position) at its own step
        eos = torch.arange(scores.shape[-1], device=scores.device) == eos_token_id
        return scores.masked_fill((state.row_steps < minimum)[:, None] & eos[None, :], NEG_INF)
    # state.step is the loop counter (host int): new tokens so far, the same for every row.
    if state.step >= minimum:
        return scores
    scores = scores.clone()  # (a scalar write: no index tensor copied from the host each step)
    scores[:, eos_token_id] = NEG_INF
    return scores


def temperature(scores: torch.Tensor, value: float | torch.Tensor) -> torch.Tensor:
    """``value``: one, or [R, 1] per row."""
    return scores / value


def top_k(scores: torch.Tensor, k: int | torch.Tensor, min_keep: int, most: int | None = None) -> torch.Tensor:
    """Keep the ``k`` best tokens of each row. ``k``: one int, or [R] per row where 0 keeps all.
    ``most``, with a per-row k: the largest k among the rows whose result is used, known on the host.
    Their k-th values then come from one top-k of that many, not a sort of the whole vocabulary (the
    same values, without sorting a quarter of a million tokens per row); a row whose k is
    larger gets a threshold that means nothing, so its result must go unused."""
    vocab = scores.shape[-1]
    if isinstance(k, int):
        k = min(max(k, min_keep), vocab)
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    elif most is not None and max(most, min_keep) < vocab:
        k = torch.where(k > 0, k.clamp(min=min_keep, max=vocab), vocab)
        best = torch.topk(scores, max(most, min_keep), dim=-1).values  # [R, most], largest first
        kth = best.gather(1, (k.clamp(max=best.shape[-1]) - 1)[:, None])
        kth = kth.masked_fill((k == vocab)[:, None], NEG_INF)  # k = 0: every token kept
    else:  # per row: one sort, each row's k-th value picked from it
        k = torch.where(k > 0, k.clamp(min=min_keep, max=vocab), vocab)
        kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p(scores: torch.Tensor, p: float | torch.Tensor, min_keep: int,
          tail: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (one value, or
    [R, 1] per row, where rows at 1.0 keep every token).

    ``tail``: the per-row ``1 - p`` [R, 1] as the host computes it (in double, then float32). For
    one value the threshold is float32(1 - p); ``1 - p`` of a float32 ``p`` differs in its last
    bits (p = 0.9: 0.10000002 instead of 0.1), which would keep a token now and then that the
    same row drops offline (and in transformers)."""
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p if tail is None else tail)  # the unlikely tail whose total mass stays within 1 - p
    if isinstance(p, torch.Tensor):
        drop &= p < 1.0
    drop[..., -min_keep:] = False
    return scores.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


TRUNCATIONS = ("top_k", "top_p")  # the steps that cut the distribution to its head


class LogitsProcessors:
    """The processors the options ask for, in transformers' order; callable like one processor."""

    def __init__(self, steps: list[tuple[str, Processor]]):
        self.steps = steps

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.steps]

    def __call__(self, scores: torch.Tensor, state: LoopState,
                 constrain: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``constrain``: a grammar's mask (scores -> scores), applied after the penalties and the
        temperature and before top-k / top-p, so those cut among the tokens the grammar allows
        (cut first, they could leave a row nothing it allows)."""
        for name, fn in self.steps:
            if constrain is not None and name in TRUNCATIONS:
                scores, constrain = constrain(scores), None
            scores = fn(scores, state)
        return scores if constrain is None else constrain(scores)

    @classmethod
    def from_options(cls, opts: GenerationOptions, eos_token_id: int | None) -> "LogitsProcessors":
        steps: list[tuple[str, Processor]] = []
        if opts.repetition_penalty != 1.0:
            steps.append(("repetition_penalty",
                          lambda s, st: repetition_penalty(s, st.sequence, st.positions, opts.repetition_penalty)))
        if opts.no_repeat_ngram_size > 0:
            steps.append(("no_repeat_ngram", lambda s, st: no_repeat_ngram(s, st, opts.no_repeat_ngram_size)))
        if opts.min_new_tokens > 0 and eos_token_id is not None:
            steps.append(("min_new_tokens", lambda s, st: min_new_tokens(s, st, opts.min_new_tokens, eos_token_id)))
        if opts.do_sample:
            # Beam sampling keeps at least one non-EOS candidate besides EOS (transformers: n_eos + 1).
            keep = 2 if opts.num_beams > 1 else 1
            if opts.temperature != 1.0:
                steps.append(("temperature", lambda s, st: temperature(s, opts.temperature)))
            if opts.top_k != 0:
                steps.append(("top_k", lambda s, st: top_k(s, opts.top_k, keep)))
            if opts.top_p < 1.0:
                steps.append(("top_p", lambda s, st: top_p(s, opts.top_p, keep)))
        return cls(steps)
