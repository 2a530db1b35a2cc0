"""The device-side token loop shared by greedy search and sampling.

One prefill, then one decode step per new token. Everything that changes per token lives in device
tensors (the next token, each row's slot, done flags, finish reasons, the output buffer); the host
only counts steps. The loop asks the device whether every row is done at most once every
``EOS_CHECK_EVERY`` steps, and never when EOS cannot end rows (``ignore_eos``), so there is no host
round-trip per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bloom_hpu.steps import StepRunner

from .batch import Batch

EOS_CHECK_EVERY = 8

RUNNING, LENGTH, EOS, STOP = 0, 1, 2, 3
FINISH_REASONS = {LENGTH: "length", EOS: "eos", STOP: "stop"}


@dataclass
class LoopHooks:
    """Optional observers of a loop, passed down from ``Generator.generate``."""

    on_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # streaming, see run_token_loop
    # (tokens [B, steps] output buffer, steps filled so far) -> [B] bool: the row's text holds a stop string
    stop_check: Callable[[torch.Tensor, int], torch.Tensor] | None = None


NO_HOOKS = LoopHooks()


@dataclass
class LoopState:
    """What a token chooser may look at. Shapes: B rows, K cache slots."""

    sequence: torch.Tensor  # [B, K] prompt + generated ids so far (pad beyond each row's end)
    lengths: torch.Tensor  # [B] prompt tokens per row
    positions: torch.Tensor  # [B] slot of the token being chosen now = lengths + step
    step: int  # host int: how many tokens each row has generated so far


# (logits [B, V] float, state) -> next tokens [B] long
TokenChooser = Callable[[torch.Tensor, LoopState], torch.Tensor]


def greedy_chooser(logits: torch.Tensor, state: LoopState) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass
class LoopOutput:
    tokens: torch.Tensor  # [B, steps] generated ids (pad after a row finished)
    finish: torch.Tensor  # [B] LENGTH or EOS
    steps_run: int


def run_token_loop(
    runner: StepRunner,
    batch: Batch,
    choose: TokenChooser,
    *,
    eos_token_id: int,
    pad_token_id: int,
    ignore_eos: bool,
    use_kv_cache: bool = True,
    hooks: LoopHooks = NO_HOOKS,
) -> LoopOutput:
    """Generate up to ``batch.new_limits[b]`` tokens for each row b.

    ``hooks.on_step(tokens [B], done [B])`` is called after each token (streaming); it receives
    device tensors and decides itself whether to synchronise. ``hooks.stop_check`` is asked with the
    EOS check, every ``EOS_CHECK_EVERY`` steps (stop strings).
    """
    plan, b = batch.plan, batch.size
    device = batch.input_ids.device
    on_step, stop_check = hooks.on_step, hooks.stop_check
    cache = runner.cache(b, plan.cache_len)
    sequence = torch.full((b, plan.cache_len), pad_token_id, dtype=torch.long, device=device)
    sequence[:, : plan.prompt_len] = batch.input_ids
    positions = batch.lengths.clone()
    out = torch.full((b, batch.steps), pad_token_id, dtype=torch.long, device=device)
    finish = torch.full((b,), RUNNING, dtype=torch.long, device=device)

    # Copies of one prompt (sampling's num_return_sequences) share its prefill.
    c = batch.copies
    logits = runner.prefill_shared(batch.input_ids[::c], batch.lengths[::c], cache, c)
    steps_run = 0
    for step in range(batch.steps):
        running = finish == RUNNING
        state = LoopState(sequence, batch.lengths, positions, step)
        token = torch.where(running, choose(logits.float(), state), pad_token_id)
        out[:, step] = token
        sequence.scatter_(1, positions.clamp(max=plan.cache_len - 1)[:, None], token[:, None])
        # A row ends with EOS (unless EOS is ignored) or when it has used its budget.
        hit_eos = running & (token == eos_token_id)
        hit_length = running & (step + 1 >= batch.new_limits)
        if not ignore_eos:
            finish.masked_fill_(hit_eos, EOS)
        finish.masked_fill_(hit_length & (finish == RUNNING), LENGTH)
        steps_run = step + 1
        if on_step is not None:
            on_step(token, finish != RUNNING)
        if step + 1 == batch.steps:
            break
        if (step + 1) % EOS_CHECK_EVERY == 0 and (stop_check is not None or not ignore_eos):
            if stop_check is not None:
                # The whole buffer (a fixed shape, no new graph per check); the hook slices on the host.
                finish.masked_fill_(stop_check(out, step + 1) & (finish == RUNNING), STOP)
            if bool((finish != RUNNING).all()):
                break
        if use_kv_cache:
            slot = positions.clamp(max=plan.cache_len - 1)  # finished rows may run past the end
            logits = runner.decode(token[:, None], slot, cache, plan.window(step))
        else:
            # Recompute the whole sequence (the recipe switch use_kv_cache=false).
            logits = runner.prefill(sequence[:, : plan.cache_len], (positions + 1).clamp(max=plan.cache_len), cache)
        positions = positions + 1
    return LoopOutput(out[:, :steps_run], finish, steps_run)
