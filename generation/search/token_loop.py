"""The device-side token loop shared by greedy search and sampling.

One prefill, then one decode step per new token, each picked by the chooser the loop is given
(``choose.chooser``: the options' processors, then greedy or a draw). Everything that changes per
token lives in device tensors (the next token, each row's slot, done flags, finish reasons, the
output buffer); the host only counts steps. The loop asks the device whether every row is done at
most once every ``EOS_CHECK_EVERY`` steps, and never when EOS cannot end rows (``ignore_eos``), so
there is no host round-trip per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bloom_hpu.runtime.steps import StepRunner, step_input

from ..run.batch import Batch
from .state import LoopState, TokenChooser

EOS_CHECK_EVERY = 8

RUNNING, LENGTH, EOS, STOP = 0, 1, 2, 3
FINISH_REASONS = {LENGTH: "length", EOS: "eos", STOP: "stop"}


@dataclass
class LoopHooks:
    """Optional observers of a loop, passed down from ``Generator.generate``."""

    on_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # streaming, see run_token_loop
    # (tokens [B, steps] output buffer, steps filled so far) -> [B] bool: the row's text holds a stop string
    stop_check: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    tick: Callable[[], None] | None = None  # after each step, on the host (progress): never reads the device
    # () -> [B] bool: rows whose grammar ended before the token chosen now (choose.GrammarSteps.ended)
    grammar_ended: Callable[[], torch.Tensor] | None = None


NO_HOOKS = LoopHooks()


@dataclass
class LoopOutput:
    tokens: torch.Tensor  # [B, K] generated ids in the first steps_run columns (pad after a row finished)
    finish: torch.Tensor  # [B] LENGTH, EOS or STOP
    steps_run: int
    counts: torch.Tensor | None = None  # [B] tokens of each row, where rows run at their own pace (speculation)


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
    # Buffers of the plan's shape, not of this batch's budgets: [K, B] holds any row's tokens (a
    # row gets fewer than K), so batches of one plan run the same ops on the same shapes.
    out = torch.full((plan.cache_len, b), pad_token_id, dtype=torch.long, device=device)  # [K, B]
    finish = torch.full((b,), RUNNING, dtype=torch.long, device=device)
    # What each step needs of the rows' lengths and budgets, made once: a step picks one row of
    # each ([S, B] -> [B]) with ``index_select`` at ``step_index``, a device counter. Not
    # ``slots[step]``: a view at a new offset every token, which lazy mode on a Gaudi hashes into a
    # new graph to compile for every token position; the same goes for ``out[step] = token``.
    steps = torch.arange(plan.cache_len, device=device)[:, None]
    # The slot of the token chosen at step s (= lengths + s); a finished row may run past the cache.
    slots = (batch.lengths[None, :] + steps).clamp(max=plan.cache_len - 1)  # [K, B]
    last_step = steps + 1 >= batch.new_limits[None, :]  # [K, B]: the row's budget ends at step s
    step_index = torch.zeros(1, dtype=torch.long, device=device)  # [1] the step, on the device

    # Copies of one prompt (sampling's num_return_sequences) share its prefill.
    c = batch.copies
    logits = runner.prefill_shared(step_input(batch.input_ids[::c]), step_input(batch.lengths[::c]), cache, c,
                                   batch.prompt_ids[::c])
    steps_run = 0
    for step in range(batch.steps):
        slot = slots.index_select(0, step_index).view(b)  # [B], its own tensor: the decode step's graph key never changes
        running = finish == RUNNING
        state = LoopState(sequence, batch.lengths, slot, step, step_index)
        token = torch.where(running, choose(logits.float(), state), pad_token_id)
        out.index_copy_(0, step_index, token[None])
        sequence.scatter_(1, slot[:, None], token[:, None])
        # A row ends with its grammar (the token now is the end the grammar forced), with EOS
        # (unless EOS is ignored) or when it has used its budget; in that order.
        if hooks.grammar_ended is not None:
            finish.masked_fill_(running & hooks.grammar_ended(), STOP)
        if not ignore_eos:
            finish.masked_fill_((finish == RUNNING) & (token == eos_token_id), EOS)
        finish.masked_fill_((finish == RUNNING) & last_step.index_select(0, step_index).view(b), LENGTH)
        steps_run = step + 1
        if on_step is not None:
            on_step(token, finish != RUNNING)
        if hooks.tick is not None:
            hooks.tick()
        if step + 1 == batch.steps:
            break
        if (step + 1) % EOS_CHECK_EVERY == 0 and (stop_check is not None or not ignore_eos):
            if stop_check is not None:
                # The whole buffer (a fixed shape, no new graph per check); the hook slices on the host.
                finish.masked_fill_(stop_check(out.t(), step + 1) & (finish == RUNNING), STOP)
            if bool((finish != RUNNING).all()):
                break
        step_index += 1
        if use_kv_cache:
            logits = runner.decode(step_input(token[:, None]), step_input(slot), cache, plan.window(step))
        else:
            # Recompute the whole sequence (the recipe switch use_kv_cache=false).
            logits = runner.prefill(sequence, slot + 1, cache)
    # The whole buffer (a fixed shape); the caller keeps each row's first steps_run tokens at most.
    return LoopOutput(out.t(), finish, steps_run)
