"""Choosing each row's next token: the one module where scores become tokens, for the offline loop
and for the server.

* ``argmax_rows``: greedy, each row's first maximum (argmax's indices, faster on the CPU).
* ``draw``: sampling, each row with its own key: ``argmax(scores + Gumbel noise)``, an exact draw
  from ``softmax(scores)`` (the Gumbel-max trick), the noise ``sampling.py``'s, a pure function of
  (row key, step, token).
* ``chooser``: the token chooser of ``Generator.generate``'s loop (``token_loop.run_token_loop``):
  the options' processors, then the rows' grammar masks where some row has one
  (``structured.py``), then greedy or a draw.
* ``choose_rows``: the server's batch of mixed requests, every option a per-row tensor
  (``serving/row_options.py``), through the same processors and the same draw, so a row chooses
  exactly what ``Generator.generate`` chooses for it alone: a neutral value leaves a row's scores
  bit-identical (x * 1.0, x / 1.0), and a row's noise depends on its own key and step only.

Beam search keeps its own top-k over its beams' candidates (``beam.py``), with the same noise when
it samples.
"""

from __future__ import annotations

import torch

from ..request.grammar import GrammarRows, allow
from .processors import repetition_penalty, temperature, top_k, top_p
from .sampling import UniformKernel, gumbel
from .state import LoopState, TokenChooser

ARGMAX_BLOCK = 128  # elements per block of argmax_rows: BLOOM pads its vocabulary to a multiple of 128


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` ([..., V] -> [...] long), the same indices (each row's first
    maximum; NaN counts as the largest, as in argmax), in two passes: the largest value of each
    block of ``ARGMAX_BLOCK``, then argmax within the first block that holds the maximum. On the
    CPU, PyTorch's argmax over a whole vocabulary compares one element at a time and its max
    reduction runs 16 lanes at a time, so two passes of the reduction beat one of argmax, at every
    step of greedy and sampled search. A vocabulary that is not a multiple of the block uses argmax
    itself."""
    V = scores.shape[-1]
    if V % ARGMAX_BLOCK or V < 2 * ARGMAX_BLOCK:
        return scores.argmax(dim=-1)
    blocks = scores.reshape(*scores.shape[:-1], V // ARGMAX_BLOCK, ARGMAX_BLOCK)  # a view where rows are dense
    block = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # [..., 1]: amax and argmax agree on NaN
    inside = blocks.gather(-2, block[..., None].expand(*block.shape, ARGMAX_BLOCK)).argmax(dim=-1)  # [..., 1]
    return (block * ARGMAX_BLOCK + inside)[..., 0]


def draw(scores: torch.Tensor, keys: torch.Tensor, step: torch.Tensor | int,
         kernel: UniformKernel | None = None) -> torch.Tensor:
    """Each row's token drawn from ``softmax(scores)`` [R, V] with its own key (``keys`` [R]) at
    ``step`` (an int, [1] or [R] per row), the noise made by ``kernel`` where the runtime has one."""
    return argmax_rows(gumbel(keys, step, scores.shape[-1], kernel).add_(scores))


def chooser(processors, keys: torch.Tensor | None = None, kernel: UniformKernel | None = None,
            grammars: "GrammarSteps | None" = None) -> TokenChooser:
    """The loop's chooser: ``processors`` (``LogitsProcessors``) on the logits, the rows' grammar
    masks (``grammars``, where the call has constraints) among them before top-k and top-p, then
    the greedy token, or with ``keys`` [B] (``sampling.row_keys``) a draw at the loop's step."""

    def scores(logits: torch.Tensor, state: LoopState) -> torch.Tensor:
        if grammars is None:
            return processors(logits, state)
        masks = grammars.masks()
        return processors(logits, state, constrain=lambda s: allow(s, masks))

    def greedy(logits: torch.Tensor, state: LoopState) -> torch.Tensor:
        return grammars.chose(argmax_rows(scores(logits, state))) if grammars else argmax_rows(scores(logits, state))

    def sampled(logits: torch.Tensor, state: LoopState) -> torch.Tensor:
        token = draw(scores(logits, state), keys, state.step_tensor, kernel)
        return grammars.chose(token) if grammars else token

    return greedy if keys is None else sampled


class GrammarSteps:
    """The offline loop's grammars (``GrammarRows``) step by step: the token chosen at step t is
    copied to the host as it is chosen, and taken into the matchers at step t + 1, after the
    device was handed step t's decode, so the host computes the next masks while the device runs
    the step. ``ended`` [B] bool on the device: rows whose grammar ended before the token being
    chosen (the loop ends them, finish reason "stop")."""

    def __init__(self, rows: GrammarRows):
        self.rows = rows
        self.pending: torch.Tensor | None = None
        self.copied = None  # CUDA: the event that ends the token's copy to the host
        self.ended = torch.zeros(len(rows.rows), dtype=torch.bool, device=rows.device)

    def masks(self) -> torch.Tensor:
        if self.pending is not None:
            if self.copied is not None:  # the copy only, which the device did before the decode
                self.copied.synchronize()
            ended = self.rows.advance(self.pending.tolist())
            if ended:
                self.ended[ended] = True
            self.pending = None
        return self.rows.masks()

    def chose(self, token: torch.Tensor) -> torch.Tensor:
        self.copied = None
        if token.device.type == "cuda":  # an asynchronous copy, its end an event: the decode is not waited for
            self.pending = token.to("cpu", non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:  # the CPU: the token itself; a Gaudi: a plain copy (its asynchronous copies are untried here)
            self.pending = token.to("cpu")
        return token


class RowFlags:
    """Which processors ``choose_rows`` runs: those some running row uses (host booleans, from the
    rows' host params, ``serving/params.SamplingParams``)."""

    def __init__(self, params_list):
        self.sample = any(p.sampling for p in params_list)
        self.repetition = any(p.repetition_penalty != 1.0 for p in params_list)
        self.openai_penalties = any(p.presence_penalty or p.frequency_penalty for p in params_list)
        self.top_k = any(p.sampling and p.top_k for p in params_list)
        # The largest k of the sampled rows, for processors.top_k's top-k in place of a sort; None
        # keeps the sort (every_processor: one shape whatever the mix of requests).
        self.top_k_most = max((p.top_k for p in params_list if p.sampling), default=0)
        self.top_p = any(p.sampling and p.top_p < 1.0 for p in params_list)
        self.grammar = any(p.grammar is not None for p in params_list)  # some row has structured output

    def every_processor(self) -> "RowFlags":
        """Every processor on (neutral values leave a row's choice bit-identical): the ops of a
        choice then depend on the batch bucket alone, not on the mix of requests, which lazy mode
        on a Gaudi would otherwise compile once per mix."""
        self.sample = self.repetition = self.openai_penalties = self.top_k = self.top_p = self.grammar = True
        self.top_k_most = None
        return self


def choose_rows(logits: torch.Tensor, opts, b: int, used: torch.Tensor, steps: torch.Tensor, flags: RowFlags,
                kernel: UniformKernel | None = None, masks: torch.Tensor | None = None) -> torch.Tensor:
    """Next token of rows 0..b-1 of a batch of mixed requests. logits [b, V] float (raw); ``opts``
    the per-row options (``serving/row_options.RowOptions``: [R] tensors, R >= b); used [b]: tokens
    the row holds (prompt + generated, = the slot of the token chosen now); steps [b]: tokens the
    row has generated (its sampling step); ``masks`` [b, ceil(V / 32)] int32: the rows' allowed
    tokens (structured output; every bit set for a row without a grammar), or None. Returns [b] long."""
    scores, sampled, sampled_rows = row_scores(logits, opts, b, used, flags, masks)
    greedy = argmax_rows(scores)
    if sampled is None:
        return greedy
    return torch.where(sampled_rows, draw(sampled, opts.keys[:b], steps, kernel), greedy)


def row_scores(logits: torch.Tensor, opts, b: int, used: torch.Tensor, flags: RowFlags,
               masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``choose_rows``'s processors without its choice: (the greedy rows' scores [b, V], after the
    penalties and the masks; the sampled rows' [b, V], after temperature, top-k and top-p, or None
    when no row samples; which rows sample [b] bool, or None). The server's speculation chooses
    from them by its own rule (``serving/speculating.py``)."""
    scores = logits
    if flags.repetition:
        scores = repetition_penalty(scores, opts.sequence[:b], used, opts.repetition[:b, None])
    if flags.openai_penalties:  # OpenAI's, over the generated tokens only: the server's alone
        counts = opts.counts[:b]
        scores = scores - opts.frequency[:b, None] * counts - opts.presence[:b, None] * (counts > 0)
    if masks is not None:  # after the penalties (which may lift a token), before any choice
        scores = allow(scores, masks)
    if not flags.sample:
        return scores, None, None
    sampled_rows = opts.temperature[:b] > 0
    # Greedy rows divide by 1 (exact) and their draw is thrown away.
    sampled = temperature(scores, torch.where(sampled_rows, opts.temperature[:b], 1.0)[:, None])
    if flags.top_k:
        sampled = top_k(sampled, opts.top_k[:b], 1, flags.top_k_most)
    if flags.top_p:
        sampled = top_p(sampled, opts.top_p[:b, None], 1, tail=opts.top_p_tail[:b, None])
    return scores, sampled, sampled_rows
