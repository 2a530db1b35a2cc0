"""Speculative decoding in ``Generator.generate``'s loop: several tokens of a row per pass over
the weights, the same tokens (greedy) or the same distribution (sampling) as the plain loop.

Each iteration, every row offers up to k guesses of its next tokens (``guesses.py``: prompt
lookup, on the device). One verify pass (``StepRunner.verify``, ``bloom_hpu/runtime/steps.py``) computes the logits of
the row's last token and its guesses, S = K + 1 positions of every row over its cache, in one
static shape per call (K: the user's k rounded up to ``guesses.K_SHAPES``; rows with fewer
guesses pad). At every position the options' processors run exactly as the plain loop would run
them had the guesses before it been chosen (the row's history with those guesses, its step
counter there), and then:

* greedy: the target's choice t_j; guess j is accepted while it equals t_j;
* sampling (rejection sampling with a point-mass draft, Leviathan et al. 2023 / Chen et al.
  2023): guess g is accepted with probability p(g), p the processed target distribution; on
  rejection the token is drawn from p with g removed, renormalised; where no guess is left, from p.

A row keeps its accepted guesses and the token chosen at the first rejected (or the bonus)
position, cut at its EOS and at its budget; rows accept their own counts and finish on their own.
The rejected guesses' keys and values stay in slots the row writes again before anything attends
them. A row whose guesses keep failing is offered fewer (adaptive k, down to 0); when no row offers
a guess, the pass is a plain decode step.

Host syncs: one read of four integers per pass (the largest guess count, whether a row still
runs, the furthest slot and the most tokens of a row: whether to verify or decode, and the
window), and the stop strings' check every ``EOS_CHECK_EVERY`` passes. Nothing inside a pass
reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from bloom_hpu.runtime.steps import StepRunner, step_input

from ..request.grammar import GrammarRows, allow
from ..run.batch import Batch
from .choose import argmax_rows, draw
from .guesses import Speculation, ngram_guesses
from .processors import NEG_INF
from .sampling import UniformKernel, uniform
from .speculative_grammar import VerifiedGrammars
from .state import LoopState
from .token_loop import EOS, EOS_CHECK_EVERY, LENGTH, NO_HOOKS, RUNNING, STOP, LoopHooks, LoopOutput

ACCEPT_SALT = 0x5EC0DE  # the accept test's uniform comes from (row key ^ this, step): not the draw's noise
PROBE_EVERY = 16  # passes a row offered nothing (k down to 0) before it is offered one guess again

# (sequence [B, L], used [B], k) -> (guesses [B, k] long, counts [B] long)
Guesser = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
GUESSERS: dict[str, Guesser] = {"ngram": ngram_guesses}  # by ``Speculation.kind`` (tests plant their own)


class GuessSource(Protocol):
    """A source of guesses with state of its own (``draft.py``'s draft model): ``begin`` when the
    target prefills the prompts, then a call every pass; ``wanted`` [B]: the most guesses each row
    may use now (0: none), the rest as ``Guesser``."""

    def begin(self, batch: Batch) -> None: ...

    def __call__(self, sequence: torch.Tensor, used: torch.Tensor, k: int,
                 wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class Stateless:
    """A ``Guesser`` (prompt lookup) as a ``GuessSource``: nothing to begin; ``wanted`` is the loop's cut."""

    def __init__(self, guesser: Guesser):
        self.guesser = guesser

    def begin(self, batch: Batch) -> None:
        pass

    def __call__(self, sequence, used, k, wanted):
        return self.guesser(sequence, used, k)


@dataclass
class SpeculationStats:
    """What a call's speculation did; ``tokens_per_verify`` and ``acceptance`` are what to report."""

    verifies: int = 0  # passes that verified guesses
    decodes: int = 0  # plain decode passes (no row offered a guess)
    offered: int = 0  # guesses offered, over rows and passes
    accepted: int = 0  # of them accepted
    row_verifies: int = 0  # (row, pass) pairs that offered at least one guess
    stepped_aside: int = 0  # calls too large to verify (``guesses.worth_verifying``), decoded without guesses

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a row kept per pass that verified its guesses (accepted + the one chosen after)."""
        return (self.accepted + self.row_verifies) / self.row_verifies if self.row_verifies else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.offered if self.offered else 0.0

    def add(self, other: "SpeculationStats") -> None:
        """Another call's counts added to these (a job's batches)."""
        for name in ("verifies", "decodes", "offered", "accepted", "row_verifies", "stepped_aside"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def describe(self) -> str:
        aside = f"; {self.stepped_aside} batch(es) too large, decoded without guesses" if self.stepped_aside else ""
        return (f"speculation: {self.tokens_per_verify:.2f} tokens/verify, acceptance {self.acceptance:.2f} "
                f"({self.verifies} verify + {self.decodes} decode passes{aside})")


def scores_at(logits: torch.Tensor, processors, sequence: torch.Tensor, guesses: torch.Tensor,
              lengths: torch.Tensor, used: torch.Tensor, generated: torch.Tensor,
              constrain=None) -> torch.Tensor:
    """The processed scores [B*S, V] of logits [B, S, V]: position j of row b as the plain loop
    would see it after choosing guesses[b, :j] (its history holds them, its step is generated + j).
    sequence [B, L + 1] (column L takes writes past the cache), guesses [B, S - 1]. ``constrain``:
    the grammars' masks, applied among the processors as the plain loop applies them."""
    b, s, _ = logits.shape
    width = sequence.shape[1] - 1
    j = torch.arange(s, device=logits.device)
    if s > 1:  # the guesses into a copy of the history, at the slots after each row's tokens
        slots = used[:, None] + j[None, : s - 1]
        sequence = sequence.clone().scatter_(1, torch.where(slots < width, slots, width), guesses)
    state = LoopState(
        sequence=sequence.repeat_interleave(s, dim=0),  # [B*S, L + 1]
        lengths=lengths.repeat_interleave(s),
        positions=(used[:, None] + j).clamp(max=width).reshape(-1),
        step=0,  # every processor reads row_steps where it is given
        row_steps=(generated[:, None] + j).reshape(-1),
    )
    return processors(logits.reshape(b * s, -1).float(), state, constrain)


def choose_and_accept(scores: torch.Tensor, guesses: torch.Tensor, counts: torch.Tensor, steps: torch.Tensor,
                      keys: torch.Tensor | None, kernel: UniformKernel | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens chosen [B, S] and guesses accepted [B] from processed scores [B*S, V] (row-major),
    guesses [B, S - 1] of which counts [B] are real, steps [B*S] each position's sampling step;
    keys [B] None: greedy. Token j is guess j where guesses 0..j are accepted; the token at the
    first rejected position is the target's (greedy: its argmax; sampled: a draw from its
    distribution without the guess); past it nothing is kept."""
    b = counts.shape[0]
    s = scores.shape[0] // b
    j = torch.arange(s, device=scores.device)
    guess = torch.cat([guesses, guesses.new_zeros(b, 1)], dim=1).reshape(-1)  # [B*S]; position S-1 has none
    offered = (j[None, :] < counts[:, None]).reshape(-1)  # [B*S]
    if keys is None:
        token = argmax_rows(scores)
        match = offered & (token == guess)
    else:
        row_keys = keys.repeat_interleave(s)
        p_guess = scores.log_softmax(dim=-1).gather(1, guess[:, None])[:, 0].exp()
        match = offered & (uniform(row_keys ^ ACCEPT_SALT, steps, 1)[:, 0] < p_guess)
        # The residual of a point-mass draft: the target without the guess (where one was offered).
        without = scores.scatter(1, guess[:, None], torch.where(offered, NEG_INF, scores.gather(1, guess[:, None])[:, 0])[:, None])
        token = torch.where(match, guess, draw(without, row_keys, steps, kernel))
    accepted = match.view(b, s).long().cumprod(dim=1).sum(dim=1)  # [B] leading guesses accepted
    return token.view(b, s), accepted


class AdaptiveK:
    """Each row's guess budget, following its acceptance: doubled after a pass that accepted
    every guess offered (up to ``most``), down to what was accepted (at least one less) after a
    pass that rejected one, halved after a pass that accepted none. A row at 0 costs no verify (when no row offers a guess, the pass is a
    plain decode); ``PROBE_EVERY`` passes later it is offered ``most`` guesses again (a verify
    pass costs the same for one guess as for ``most``), so text that starts to repeat is noticed;
    a probe that accepts nothing puts it back at 0 at once.
    ``update`` runs after every pass, decodes included: they count a row's wait."""

    def __init__(self, rows: int, most: int, device):
        self.most = most
        self.k = torch.full((rows,), most, dtype=torch.long, device=device)
        self.idle = torch.zeros(rows, dtype=torch.long, device=device)
        self.probing = torch.zeros(rows, dtype=torch.bool, device=device)  # offered a probe, not yet tried

    def update(self, offered: torch.Tensor, accepted: torch.Tensor) -> None:
        tried = offered > 0
        every = tried & (accepted == offered)
        k = torch.where(every, (2 * self.k).clamp(max=self.most),
                        torch.where(tried, torch.where(accepted > 0, torch.maximum(accepted, self.k - 1), self.k // 2),
                                    self.k))
        k = torch.where(tried & self.probing & (accepted == 0), 0, k)  # a failed probe: back to 0 at once
        self.probing &= ~tried
        self.idle = torch.where(k == 0, self.idle + 1, 0)
        probe = self.idle >= PROBE_EVERY
        self.k = torch.where(probe, self.most, k)
        self.idle = torch.where(probe, 0, self.idle)
        self.probing |= probe


def run_speculative_loop(
    runner: StepRunner,
    batch: Batch,
    processors,
    speculation: Speculation,
    *,
    eos_token_id: int,
    pad_token_id: int,
    ignore_eos: bool,
    keys: torch.Tensor | None = None,
    kernel: UniformKernel | None = None,
    hooks: LoopHooks = NO_HOOKS,
    grammars: GrammarRows | None = None,
    guesser: Guesser | GuessSource | None = None,
    adaptive: bool = True,
) -> tuple[LoopOutput, SpeculationStats]:
    """``token_loop.run_token_loop`` with guesses: up to ``batch.new_limits[b]`` tokens of each row
    b, chosen by ``processors``, the rows' ``grammars`` masks (structured output), then greedy
    (``keys`` None) or drawn with the rows' ``keys``.
    Returns the loop's output (``counts``: each row's tokens) and what speculation did.
    ``hooks``: as the plain loop's; ``on_step`` and ``tick`` get the plain loop's steps (step n:
    every row's n-th token), a step as soon as every running row has its token, so several a pass.
    ``guesser``: where guesses come from, a ``Guesser`` or a ``GuessSource`` (None:
    ``GUESSERS[speculation.kind]``); ``adaptive``: adaptive k."""
    guesser = guesser or GUESSERS[speculation.kind]
    source = guesser if hasattr(guesser, "begin") else Stateless(guesser)
    verified = VerifiedGrammars(grammars) if grammars is not None else None
    plan, b = batch.plan, batch.size
    device = batch.input_ids.device
    width = plan.cache_len  # L
    shape_k = speculation.shape_k
    cache = runner.cache(b, width)
    # Column L of these takes the writes a row does not keep (a fixed-shape scatter, no mask of a view).
    sequence = torch.full((b, width + 1), pad_token_id, dtype=torch.long, device=device)
    sequence[:, : plan.prompt_len] = batch.input_ids
    out = torch.full((b, width + 1), pad_token_id, dtype=torch.long, device=device)
    finish = torch.full((b,), RUNNING, dtype=torch.long, device=device)
    generated = torch.zeros(b, dtype=torch.long, device=device)  # [B] tokens each row has
    used = batch.lengths.clone()  # [B] slots each row holds = the slot of its next token
    limits = batch.new_limits
    last = torch.zeros(b, dtype=torch.long, device=device)  # each row's latest token (not yet fed)
    budget = AdaptiveK(b, speculation.k, device)
    totals = torch.zeros(3, dtype=torch.long, device=device)  # offered, accepted, row_verifies
    stats = SpeculationStats()

    c = batch.copies
    logits = runner.prefill_shared(step_input(batch.input_ids[::c]), step_input(batch.lengths[::c]), cache, c,
                                   batch.prompt_ids[::c])[:, None]  # [B, 1, V]
    source.begin(batch)
    guesses = torch.zeros(b, 0, dtype=torch.long, device=device)
    counts = torch.zeros(b, dtype=torch.long, device=device)
    passes = 0
    emitted = 0  # steps the hooks were given: every row's first ``emitted`` tokens
    while True:
        s = logits.shape[1]
        j = torch.arange(s, device=device)
        steps = (generated[:, None] + j).reshape(-1)
        constrain = None
        if verified is not None:  # the grammar's mask at every position, where the plain loop applies it
            masks, grammar_ended = verified.masks(guesses, counts)
            constrain = lambda scores: allow(scores, masks)  # noqa: E731
        scores = scores_at(logits, processors, sequence, guesses, batch.lengths, used, generated, constrain)
        token, accepted = choose_and_accept(scores, guesses, counts, steps, keys, kernel)  # [B, S], [B]
        # What each running row keeps: its accepted guesses and the token after, cut where its
        # grammar ended, after an EOS and at its budget; the row ends with the first of them it keeps.
        running = finish == RUNNING
        kept = accepted + 1
        if verified is not None:
            first_end = first_where(grammar_ended & (j[None, :] < kept[:, None]))
            kept = torch.minimum(kept, first_end + 1)
        if not ignore_eos:
            first_eos = first_where((token == eos_token_id) & (j[None, :] < kept[:, None]))
            kept = torch.minimum(kept, first_eos + 1)
        kept = torch.where(running, torch.minimum(kept, limits - generated), 0)
        keep = j[None, :] < kept[:, None]  # [B, S]
        out.scatter_(1, torch.where(keep, generated[:, None] + j, width), token)
        sequence.scatter_(1, torch.where(keep & (used[:, None] + j < width), used[:, None] + j, width), token)
        last = torch.where(kept > 0, token.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0], last)
        generated += kept
        used += kept
        if verified is not None:  # the grammar first, as in the plain loop: a forced end that is EOS ends with "stop"
            finish.masked_fill_(running & (first_end < kept), STOP)
            verified.take(token, kept)
        if not ignore_eos:
            finish.masked_fill_((finish == RUNNING) & (first_eos < kept), EOS)
        finish.masked_fill_((finish == RUNNING) & (generated >= limits), LENGTH)
        if s > 1:
            totals += torch.stack([counts.sum(), accepted.sum(), (counts > 0).sum()])
        if adaptive:  # every pass, decodes too: they count the passes a row at 0 waits for its probe
            budget.update(counts, accepted)
        passes += 1
        if hooks.stop_check is not None and passes % EOS_CHECK_EVERY == 0:
            most = int(generated.max())
            finish.masked_fill_(hooks.stop_check(out[:, :width], most) & (finish == RUNNING), STOP)
        # The next pass: each running row's guesses, within its adaptive k and its budget (the
        # token after the guesses is always kept, so a row with r tokens left guesses r - 1).
        room = (limits - generated - 1).clamp(min=0)
        wanted = torch.where(finish == RUNNING, torch.minimum(budget.k, room), 0)
        guesses, counts = source(sequence[:, :width], used, shape_k, wanted)
        counts = torch.minimum(counts, wanted)
        most_guesses, any_running, furthest, most_tokens, slowest = torch.stack(
            [counts.max(), (finish == RUNNING).any().long(), used.max(), generated.max(),
             torch.where(finish == RUNNING, generated, width).min()]).tolist()
        emitted = give_steps(hooks, out, finish, generated, emitted, slowest if any_running else most_tokens)
        if not any_running:
            break
        # Window: the slot of the furthest row's last position fed, + 1 (plan.window's rounding).
        fed = 1 + (shape_k if most_guesses else 0)
        window = plan.window(max(0, furthest + fed - 2 - plan.longest_prompt))
        starts = (used - 1).clamp(max=width - 1)
        if most_guesses == 0:
            logits = runner.decode(step_input(last[:, None]), step_input(starts), cache, window)[:, None]
            guesses = guesses[:, :0]
            stats.decodes += 1
        else:
            ids = torch.cat([last[:, None], guesses], dim=1)  # [B, K + 1]
            logits = runner.verify(step_input(ids), step_input(starts), cache, window)
            stats.verifies += 1
    stats.offered, stats.accepted, stats.row_verifies = totals.tolist()
    return LoopOutput(out[:, :width], finish, most_tokens, counts=generated), stats


def first_where(flags: torch.Tensor) -> torch.Tensor:
    """[B, S] bool -> [B] long: each row's first True position, S where it has none."""
    return torch.where(flags.any(dim=1), flags.long().argmax(dim=1), flags.shape[1])


def give_steps(hooks: LoopHooks, out: torch.Tensor, finish: torch.Tensor, generated: torch.Tensor,
               given: int, ready: int) -> int:
    """The plain loop's hook calls for steps ``given .. ready - 1`` (every running row holds their
    tokens): ``on_step(tokens [B], done [B])`` with each row's token of that step (pad past a
    finished row's last one, whose step is its last done: False before it) and ``tick()``.
    Returns the steps now given. ``out`` [B, L + 1]: each row's tokens from column 0."""
    for n in range(given, ready):
        if hooks.on_step is not None:
            # A column view, its offset new every step: only where a hook watches (on a Gaudi a
            # view at a new offset is a new lazy graph; streaming reads the host every step anyway).
            hooks.on_step(out[:, n], (finish != RUNNING) & (generated <= n + 1))
        if hooks.tick is not None:
            hooks.tick()
    return max(given, ready)
