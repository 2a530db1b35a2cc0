"""Speculation's second source of guesses: a draft model, a smaller BLOOM with the target's tokenizer
(bloom-560m for bloom-7b1), run a few greedy steps ahead of every row.

The draft is loaded like the target (its own ``StaticBloom``, ``StepRunner`` and backend, the same
device, dtype and CPU options) and keeps its own static KV cache of the call's shape. Per call:

* ``begin``: when the target prefills the prompts, the draft prefills them too;
* each pass (``__call__``): the draft first *catches up* on the tokens the target chose that it
  did not feed (the token after the accepted guesses, a bonus token, or the tokens of passes it
  sat out): where every row lacks only its last token, one decode step; else passes of
  ``CATCH_UP`` positions over its cache (its verify step). The logits at a row's last token give
  its first guess, and ``n - 1`` decode steps the others (n: the most guesses any row may use now).
  Its cache past what the row kept is simply written again later, as the target's: a slot's keys
  and values depend only on the tokens up to it, so the proposals the target accepted stay valid
  and the rest are overwritten before anything attends them.

The draft's guesses are its greedy choices (the argmax of its raw logits), a point-mass draft: the
target's rejection rule (``speculation.choose_and_accept``) then keeps its distribution exactly, as
with prompt lookup. (A sampled draft would need q(x) in that rule; not done.)

Host syncs: one read of three integers per pass (the most guesses wanted, the furthest row, the
furthest behind), besides the loop's own. When no row wants a guess (adaptive k at 0) the draft
does nothing, and catches up on the tokens it missed when a row wants guesses again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bloom_hpu.checkpoint import CheckpointError, resolve_checkpoint
from bloom_hpu.config import BloomConfig
from bloom_hpu.quantize import stored_quantization
from bloom_hpu.runtime.steps import StepRunner, step_input

from ..request.memory import MemoryCheckError, agreed_free_bytes, estimate_bytes, human
from ..request.validate import check_checkpoint
from ..run.batch import Batch
from .choose import argmax_rows
from .guesses import SpeculationError

CATCH_UP = 2  # positions of a catch-up pass: a row is at most 2 tokens behind after a pass it drafted for


@dataclass
class DraftModel:
    """A loaded draft: its runner (model, backend, caches) and where it came from."""

    runner: StepRunner
    folder: Path

    @property
    def config(self) -> BloomConfig:
        return self.runner.model.config

    def guesser(self) -> "DraftGuesser":
        """A fresh guess source for one call (its cache is the runner's, reused across calls)."""
        return DraftGuesser(self.runner)

    def call_bytes(self, rows: int, length: int, prompt_len: int) -> int:
        """What a call of ``rows`` x ``length`` adds on the draft's side: its cache and buffers."""
        model = self.runner.model
        return estimate_bytes(self.config, model.ln_f.weight.dtype, rows, length, prompt_len,
                              model.parallel.world_size)


def check_draft(draft_model, target_folder: Path, target: BloomConfig) -> tuple[Path, BloomConfig]:
    """The draft's folder and config, checked against the target before anything is loaded: a
    BLOOM checkpoint whose vocabulary (config.json's vocab_size, the tokenizer's tokens and ids,
    EOS and padding ids) is the target's. Anything else: ``SpeculationError``."""
    if not isinstance(draft_model, (str, Path)):
        raise TypeError(f"draft_model must be a folder path, got {type(draft_model).__name__}")
    try:
        folder = resolve_checkpoint(str(draft_model), None)
        check_checkpoint(folder)
    except CheckpointError as error:
        raise SpeculationError(f"draft model: {error}") from None
    draft = BloomConfig.from_json(folder / "config.json")
    name = f"the draft model {folder}"
    if draft.vocab_size != target.vocab_size:
        raise SpeculationError(f"{name} has vocab_size {draft.vocab_size}, the target {target.vocab_size}: a draft "
                               "must share the target's vocabulary and tokenizer")
    for field in ("eos_token_id", "pad_token_id"):
        if getattr(draft, field) != getattr(target, field):
            raise SpeculationError(f"{name} has {field} {getattr(draft, field)}, the target "
                                   f"{getattr(target, field)}: a draft must share the target's tokenizer")
    if _vocabulary(folder) != _vocabulary(target_folder):
        raise SpeculationError(f"{name}'s tokenizer.json is not the target's (other tokens or ids): a draft must "
                               "share the target's tokenizer")
    return folder, draft


def _vocabulary(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as error:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpeculationError(f"cannot read the tokenizer {path}: {first}") from None


def weight_bytes(config: BloomConfig, dtype: torch.dtype, world_size: int = 1) -> int:
    """The weights of ``config`` as they load on one rank (an upper bound: float in ``dtype``
    while loading, int8/int4 as stored where the checkpoint is stored quantized)."""
    h, item = config.hidden_size, torch.empty((), dtype=dtype).element_size()
    products = config.n_layer * 12 * h * h  # qkv 3h², dense h², the MLP's 4h² twice
    rest = config.vocab_size * h + config.n_layer * 13 * h + 4 * h  # embedding (tied head), biases, LayerNorms
    stored = stored_quantization(config)
    per_weight = item if stored is None else {"int8": 1.0, "int4": 0.5 + 4 / (stored[1] or 64)}[stored[0]]
    return int((products * per_weight + rest * item) / world_size)


def check_draft_fits(folder: Path, config: BloomConfig, dtype: torch.dtype, device: torch.device, parallel) -> None:
    """Refuse a draft whose weights cannot fit the memory free now (after the target loaded)."""
    need = weight_bytes(config, dtype, parallel.world_size)
    free = agreed_free_bytes(device, parallel)
    if free is not None and need > free:
        raise MemoryCheckError(f"the draft model {folder} needs about {human(need)} for its weights on {device.type}, "
                               f"but {human(free)} is free once the target is loaded; give a smaller draft")


class DraftGuesser:
    """One call's draft: told of the prompts (``begin``), then asked for guesses every pass.

    State per row: ``fed`` [B], the leading slots of its cache that hold the row's tokens'
    keys and values; the proposals it fed last time (``proposed`` [B, n - 1], from slot ``at``)."""

    def __init__(self, runner: StepRunner):
        self.runner = runner

    def begin(self, batch: Batch) -> None:
        self.plan = batch.plan
        self.cache = self.runner.cache(batch.size, self.plan.cache_len)
        c = batch.copies
        self.runner.prefill_shared(step_input(batch.input_ids[::c]), step_input(batch.lengths[::c]), self.cache, c)
        self.fed = batch.lengths.clone()  # the prompt (its last token's logits are computed again at the first pass)
        self.proposed: torch.Tensor | None = None
        self.at = self.fed

    def __call__(self, sequence: torch.Tensor, used: torch.Tensor, k: int,
                 wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Guesses [B, k] and counts [B] for rows whose tokens are ``sequence[b, :used[b]]`` [B, L],
        ``wanted`` [B] the most guesses each may use now (0: none)."""
        rows, width = sequence.shape
        self._roll_back(sequence, used)
        most, furthest, behind = torch.stack([wanted.max(), used.max(), (used - self.fed).max()]).tolist()
        guesses = torch.zeros(rows, k, dtype=torch.long, device=sequence.device)
        if most == 0:  # no row guesses this pass: the draft sits it out and catches up later
            return guesses, torch.zeros_like(used)
        # Every slot fed below: up to a row's last token (catch-up), then its guesses but the last.
        window = self.plan.window(max(0, furthest + most - 2 - self.plan.longest_prompt))
        if behind == 1:  # every row's last token only (a guess was rejected): a decode step, the cheaper shape
            last = (used - 1).clamp(max=width - 1)
            token = argmax_rows(self.runner.decode(step_input(sequence.gather(1, last[:, None])), step_input(last),
                                                   self.cache, window))
        else:
            for _ in range(-(-(behind - CATCH_UP) // CATCH_UP)):  # passes it sat out: all but the last CATCH_UP tokens
                self._feed(sequence, used, window, advance=True)
            logits = self._feed(sequence, used, window, advance=False)  # [B, CATCH_UP, V]
            token = argmax_rows(logits[torch.arange(rows, device=used.device), used - 1 - self.fed])  # at each row's last
        chosen = [token]
        for j in range(1, most):  # guess j - 1 fed at slot used + j - 1
            positions = (used + j - 1).clamp(max=width - 1)
            token = argmax_rows(self.runner.decode(step_input(token[:, None]), step_input(positions), self.cache, window))
            chosen.append(token)
        guesses[:, :most] = torch.stack(chosen, dim=1)
        self.fed, self.at = used.clone(), used.clone()
        self.proposed = guesses[:, : most - 1].clone()
        return guesses, torch.full_like(used, most)

    def _roll_back(self, sequence: torch.Tensor, used: torch.Tensor) -> None:
        """``fed`` after the target's pass: the proposals fed last time count as long as the row
        kept them; at most up to the row's last token (whose logits the next guess needs)."""
        if self.proposed is not None and self.proposed.shape[1]:
            slots = self.at[:, None] + torch.arange(self.proposed.shape[1], device=used.device)  # [B, n - 1]
            kept = sequence.gather(1, slots.clamp(max=sequence.shape[1] - 1)) == self.proposed
            kept &= slots < used[:, None]
            self.fed = self.at + kept.long().cumprod(dim=1).sum(dim=1)
        self.proposed = None
        self.fed = torch.minimum(self.fed, used - 1)

    def _feed(self, sequence: torch.Tensor, used: torch.Tensor, window: int, advance: bool) -> torch.Tensor:
        """One pass of ``CATCH_UP`` positions of every row from its slot ``fed`` (those past its
        last token write slots that are written again before they are attended): logits
        [B, CATCH_UP, V]. ``advance``: move ``fed`` on, leaving every row one token at least."""
        width = sequence.shape[1]
        slots = self.fed[:, None] + torch.arange(CATCH_UP, device=used.device)
        ids = sequence.gather(1, slots.clamp(max=width - 1))
        logits = self.runner.verify(step_input(ids), step_input(self.fed.clamp(max=width - 1)), self.cache, window)
        if advance:
            self.fed = self.fed + torch.minimum(used - 1 - self.fed, torch.tensor(CATCH_UP, device=used.device))
        return logits
