"""Stop strings: a sequence ends where its text first contains one of them.

Two halves. During the loop, ``StopChecker`` is asked every few steps (with the EOS check, never
per token) which rows' text already holds a stop string; those rows are marked finished, and the
loop ends early once every row is. After the loop, ``cut_at_stop`` makes the result exact, whatever
search produced it: the text ends just before the first stop string (which is not included), the
token ids keep only the tokens needed to spell that text, and the finish reason becomes "stop".
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..results import Sequence


class StopError(ValueError):
    """A malformed ``stop`` value; the message is meant for the user."""


def normalize_stops(stop) -> list[str]:
    """``None``, a string, or a list of strings -> a list of non-empty strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise StopError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise StopError("stop strings must not be empty")
    return list(stop)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(seq: Sequence, stops: list[str], tokenizer) -> Sequence:
    """The sequence up to (not including) its first stop string; unchanged when there is none."""
    cut = first_stop(seq.text, stops) if stops else None
    if cut is None:
        return seq
    ids = seq.token_ids
    # The shortest token prefix whose text covers everything before the stop string. Its last
    # token may also hold the start of the stop string; the text is cut exactly regardless.
    keep = next((n for n in range(len(ids) + 1) if len(tokenizer.decode(ids[:n])) >= cut), len(ids))
    logprobs = seq.token_logprobs[:keep] if seq.token_logprobs is not None else None
    return replace(seq, text=seq.text[:cut], token_ids=ids[:keep], finish_reason="stop", token_logprobs=logprobs)


class StopChecker:
    """Host-side check of stop strings over the tokens generated so far, one call per batch of
    steps. ``stops[b]`` are row b's stop strings (rows may differ)."""

    def __init__(self, tokenizer, stops: list[list[str]]):
        self.tokenizer = tokenizer
        self.stops = stops

    @property
    def active(self) -> bool:
        return any(self.stops)

    def __call__(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """tokens [B, S] (device) of which ``steps`` are generated -> [B] bool (same device): the
        row's text holds a stop string."""
        rows = [row[:steps] for row in tokens.tolist()]  # the one host copy of this check
        # Loops that run several rows per prompt (num_return_sequences) keep a prompt's rows together.
        per_prompt = max(1, len(rows) // max(1, len(self.stops)))
        hit = [bool(stops) and first_stop(self.tokenizer.decode(row), stops) is not None
               for row, stops in zip(rows, (s for s in self.stops for _ in range(per_prompt)))]
        hit += [False] * (len(rows) - len(hit))
        return torch.tensor(hit, dtype=torch.bool, device=tokens.device)


def stops_per_prompt(stop, n_prompts: int) -> list[list[str]]:
    """``stop`` for every prompt alike (None, a string, a list of strings), or a list holding one
    such value per prompt -> one list of stop strings per prompt."""
    if isinstance(stop, (list, tuple)) and stop and all(s is None or isinstance(s, (list, tuple)) for s in stop):
        if len(stop) != n_prompts:
            raise StopError(f"got {len(stop)} lists of stop strings for {n_prompts} prompts")
        return [normalize_stops(s) for s in stop]
    return [normalize_stops(stop)] * n_prompts
