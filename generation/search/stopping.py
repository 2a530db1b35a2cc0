"""Stop strings: the values a caller may give, and the loop's check of them.

A sequence ends just before the first stop string its text holds (``text_ends``). During the loop,
``StopChecker`` is asked every few steps (with the EOS check, never per token) which rows' text
already holds one; those rows are marked finished, and the loop ends early once every row is. The
sequences are then cut exactly, whatever search produced them (``results.make_sequence``).
"""

from __future__ import annotations

import torch

from .text_ends import text_end


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


class StopChecker:
    """Host-side check of stop strings over the tokens generated so far, one call per batch of
    steps. ``stops[b]`` are row b's stop strings (rows may differ)."""

    def __init__(self, tokenizer, stops: list[list[str]]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.stopped: set[int] = set()  # rows found stopped stay so (tokens are only appended): not decoded again

    @property
    def active(self) -> bool:
        return any(self.stops)

    def __call__(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """tokens [B, S] (device) of which ``steps`` are generated -> [B] bool (same device): the
        row's text holds a stop string."""
        rows = [row[:steps] for row in tokens.tolist()]  # the one host copy of this check
        # Loops that run several rows per prompt (num_return_sequences) keep a prompt's rows together.
        per_prompt = max(1, len(rows) // max(1, len(self.stops)))
        for r, (row, stops) in enumerate(zip(rows, (s for s in self.stops for _ in range(per_prompt)))):
            if stops and r not in self.stopped and text_end(row, stops, self.tokenizer).reason == "stop":
                self.stopped.add(r)
        hit = [r in self.stopped for r in range(len(rows))]
        return torch.tensor(hit, dtype=torch.bool, device=tokens.device)


def stops_per_prompt(stop, n_prompts: int) -> list[list[str]]:
    """``stop`` for every prompt alike (None, a string, a list of strings), or a list holding one
    such value per prompt -> one list of stop strings per prompt."""
    if isinstance(stop, (list, tuple)) and stop and all(s is None or isinstance(s, (list, tuple)) for s in stop):
        if len(stop) != n_prompts:
            raise StopError(f"got {len(stop)} lists of stop strings for {n_prompts} prompts")
        return [normalize_stops(s) for s in stop]
    return [normalize_stops(stop)] * n_prompts
