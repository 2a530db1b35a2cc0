"""Speculative decoding in the server: each running row offers guesses of its next tokens, and one
pass over the weights verifies every row's at once (``--serve --speculate ngram[:K]|draft[:K]``).

The rule is the offline loop's (``search/speculation.py``), row by row:

* **Guesses** (``propose``): prompt lookup over the row's prompt and output (``guesses.ngram_guesses``),
  on the host, where the engine already holds every row's tokens, so the step reads nothing back
  from the device for them; or a draft model's greedy continuation (``drafting.py``: its own
  cache in the engine's slots, its guesses read back once a step). At most the row's adaptive k
  (``speculation.AdaptiveK``, one per row, down to 0) and never past its budget or the cache
  (``offered``). Rows with a grammar offer none (their one token a pass is chosen as without
  speculation).
* **Verify**: the engine's decode step becomes a verify pass of [b, K + 1] (each row's last token
  and its guesses, padded to ``guesses.K_SHAPES``'s K): logits at every position, [b, K + 1, V].
  A step that carries prompt segments stays a plain mixed step (its rows offer no guesses then).
* **Choice** (``choose_verified``): at every position the row's own processors run as the plain
  step would run them had the guesses before it been chosen (its history and penalty counts with
  them, its sampling step there: ``PositionOptions``), then greedy rows accept while the guess is
  their argmax and sampled rows by the rejection rule of a point-mass draft (``choose_and_accept``).
  The engine hands the kept tokens out one position at a time, so EOS, stop strings, budgets and
  streaming decide exactly as they do for one token a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..search.choose import RowFlags, row_scores
from ..search.guesses import Speculation, ngram_guesses
from ..search.speculation import AdaptiveK, choose_and_accept
from .drafting import draft_guesses


def offers_guesses(params) -> bool:
    """Whether a request's rows speculate: greedy rows without a grammar. Not with a grammar (its
    matcher would have to follow every guess on the host and roll back the rejected ones); not
    when sampling: a batch large enough to step aside (``guesses.worth_verifying``) decodes
    instead, and a sampled row's draws differ between the two, so its seeded text would depend on
    the requests it shares the engine with. Greedy rows give the same tokens either way."""
    return params.grammar is None and not params.sampling


def propose(rows: list, speculation: Speculation, max_length: int,
            device_rows=None) -> tuple[list[list[int]], list[int]]:
    """Each slot's guesses (``shape_k`` ids, padded with 0) and how many are real, for ``rows``
    (the bucket's Row objects or None); a row that is not running, or offers none, gets 0. The
    guesses come from prompt lookup, or with ``speculation.kind`` "draft" from the draft model
    that ``device_rows`` runs (``drafting.py``)."""
    k = speculation.shape_k
    wants = offered(rows, speculation, max_length)
    if speculation.kind == "draft":
        return draft_guesses(device_rows, rows, wants, k)
    guesses, counts = [[0] * k for _ in rows], [0] * len(rows)
    live = [i for i, want in enumerate(wants) if want]
    if not live:
        return guesses, counts
    histories = [rows[i].handle.prompt_ids + rows[i].ids for i in live]
    longest = max(map(len, histories))
    sequence = torch.zeros(len(live), longest, dtype=torch.long)
    for n, history in enumerate(histories):
        sequence[n, : len(history)] = torch.tensor(history)
    used = torch.tensor([len(h) for h in histories])
    found, found_counts = ngram_guesses(sequence, used, k)
    for n, i in enumerate(live):
        count = min(int(found_counts[n]), wants[i])
        guesses[i][:count] = found[n, :count].tolist()
        counts[i] = count
    return guesses, counts


def offered(rows: list, speculation: Speculation, max_length: int) -> list[int]:
    """The most guesses each slot's row may offer now: its adaptive k, never past its budget or
    the cache (0: a free slot, a joining row, a row that does not guess)."""
    wants = [0] * len(rows)
    for i, row in enumerate(rows):
        if row is None or not row.running or not offers_guesses(row.handle.params):
            continue
        if row.guess_budget is None:  # a row's own budget (it moves with the row between slots)
            row.guess_budget = Budget(speculation.k)
        last_slot = row.prompt_len + len(row.ids) - 1  # the slot its last token goes to
        room = min(row.limit - len(row.ids) - 1, max_length - 1 - last_slot)  # the token after is always kept
        wants[i] = max(0, min(row.guess_budget.k, room))
    return wants


@dataclass
class Budget:
    """A row's state in ``speculation.AdaptiveK``, kept on the row as host values."""

    most: int
    k: int = -1  # guesses it may offer now (-1: ``most``)
    idle: int = 0
    probing: bool = False

    def __post_init__(self):
        if self.k < 0:
            self.k = self.most


def adapt(rows: list, offered: list[int], accepted: list[int]) -> None:
    """After a pass (verify or plain decode, which counts a row's wait for its probe), each running
    row's budget follows what it accepted: ``AdaptiveK.update`` over the rows at once."""
    budgets = [row.guess_budget if row is not None else None for row in rows]
    have = [b for b in budgets if b is not None]
    if not have:
        return
    stand_in = Budget(have[0].most)  # free slots: updated, thrown away
    budgets = [b or stand_in for b in budgets]
    adaptive = AdaptiveK(len(budgets), have[0].most, "cpu")
    adaptive.k = torch.tensor([b.k for b in budgets])
    adaptive.idle = torch.tensor([b.idle for b in budgets])
    adaptive.probing = torch.tensor([b.probing for b in budgets])
    adaptive.update(torch.tensor(offered), torch.tensor(accepted))
    for b, k, idle, probing in zip(budgets, adaptive.k.tolist(), adaptive.idle.tolist(), adaptive.probing.tolist()):
        b.k, b.idle, b.probing = k, idle, probing


class PositionOptions:
    """The per-row options (``row_options.RowOptions``) of b rows at S verified positions, as
    [b*S] rows (row-major): position j of row r sees r's options, its history with guesses[r, :j]
    chosen (repetition penalty) and their counts (OpenAI's penalties)."""

    def __init__(self, opts, b: int, s: int, used: torch.Tensor, guesses: torch.Tensor, flags: RowFlags):
        each = lambda t: t[:b].repeat_interleave(s, dim=0)  # noqa: E731
        self.temperature, self.top_p, self.top_p_tail = each(opts.temperature), each(opts.top_p), each(opts.top_p_tail)
        self.top_k, self.repetition, self.keys = each(opts.top_k), each(opts.repetition), each(opts.keys)
        self.presence, self.frequency = each(opts.presence), each(opts.frequency)
        if flags.repetition:  # the guesses into a copy of the history, at the slots after each row's tokens
            width = opts.sequence.shape[1]
            slots = (used[:, None] + torch.arange(s - 1, device=used.device)).clamp(max=width - 1)
            self.sequence = each(opts.sequence[:b].clone().scatter_(1, slots, guesses))
        if flags.openai_penalties:  # position j counts guesses 0..j-1 as generated
            added = torch.zeros(b, s, opts.counts.shape[1], device=guesses.device)
            added[:, 1:].scatter_(2, guesses[:, :, None], 1.0)
            self.counts = (opts.counts[:b, None] + added.cumsum(dim=1)).reshape(b * s, -1)


def choose_verified(logits: torch.Tensor, opts, b: int, used: torch.Tensor, steps: torch.Tensor,
                    guesses: torch.Tensor, counts: torch.Tensor, flags: RowFlags, kernel=None,
                    masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [b, S] and guesses accepted [b] of a verify pass's logits [b, S, V]: used [b] and
    steps [b] as ``choose_rows`` takes them (at position 0), guesses [b, S - 1] of which counts [b]
    are real, masks [b, V/32] (rows with a grammar offer no guesses: only position 0 is kept)."""
    s = logits.shape[1]
    j = torch.arange(s, device=logits.device)
    at_used = (used[:, None] + j).reshape(-1)  # [b*S]
    at_steps = (steps[:, None] + j).reshape(-1)
    each = PositionOptions(opts, b, s, used, guesses, flags)
    if masks is not None:
        masks = masks.repeat_interleave(s, dim=0)
    scores, sampled, sampled_rows = row_scores(logits.reshape(b * s, -1), each, b * s, at_used, flags, masks)
    token, accepted = choose_and_accept(scores, guesses, counts, at_steps, None, None)
    if sampled is not None:
        drawn, drawn_accepted = choose_and_accept(sampled, guesses, counts, at_steps, opts.keys[:b], kernel)
        rows = sampled_rows[::s]
        token = torch.where(rows[:, None], drawn, token)
        accepted = torch.where(rows, drawn_accepted, accepted)
    return token, accepted
