"""Per-row options as device tensors, and the token choice of a whole batch of mixed requests.

Every option a request may set is one entry of a [max_batch] tensor, so a batch that mixes greedy
and sampled rows, temperatures, top-k/top-p and penalties runs the very same ops on the same
shapes; nothing splits the batch. Whole processors are skipped when no running row uses them (a
host-known fact from admission, not a read-back from the device).

The processors and the draw are those of ``search/processors.py`` and ``search/sampling.py``, given
per-row tensors, so a row chooses exactly what ``Generator.generate`` chooses for it alone: a
neutral value leaves a row's scores bit-identical (x * 1.0, x / 1.0), and the sampling noise of a
row is a pure function of (row key, its own step, token), whichever rows share the batch.
"""

from __future__ import annotations

import torch

from bloom_hpu.runtime.transfer import host_to_device

from ..search.processors import repetition_penalty, temperature, top_k, top_p
from ..search.sampling import UniformKernel, draw
from ..search.token_loop import argmax_rows


class RowOptions:
    """[R] tensors of per-row options (R = max_batch), indexed by slot."""

    def __init__(self, rows: int, vocab: int, max_length: int, device, pad_token_id: int):
        self.vocab = vocab
        self.pad_token_id = pad_token_id
        f = dict(dtype=torch.float32, device=device)
        i = dict(dtype=torch.long, device=device)
        self.temperature = torch.zeros(rows, **f)  # 0: greedy
        self.top_p = torch.ones(rows, **f)
        self.top_p_tail = torch.zeros(rows, **f)  # 1 - top_p, computed on the host (processors.top_p)
        self.top_k = torch.zeros(rows, **i)
        self.repetition = torch.ones(rows, **f)
        self.presence = torch.zeros(rows, **f)
        self.frequency = torch.zeros(rows, **f)
        self.keys = torch.zeros(rows, **i)  # sampling keys (search/sampling.row_keys)
        # Each row's prompt + generated ids (repetition penalty) and counts of generated ids
        # (presence/frequency penalties), [R, K] and [R, V].
        self.sequence = torch.full((rows, max_length), pad_token_id, **i)
        self.counts = torch.zeros(rows, vocab, **f)
        self._tensors = [self.temperature, self.top_p, self.top_p_tail, self.top_k, self.repetition, self.presence,
                         self.frequency, self.keys, self.sequence, self.counts]

    def set_row(self, slot: int, params, key: int, prompt: list[int]) -> None:
        """A new request's row (host values written once, at admission; ``prompt`` its ids: the
        penalties only read the slots the row has filled).

        Written with ``index_copy_`` of host-made tensors at a device index: one op per option of
        one shape, whatever the slot and the values (a scalar written at ``t[slot]`` is a view at
        a new offset and a new constant, which lazy mode on a Gaudi would compile anew)."""
        device = self.temperature.device
        at = host_to_device(torch.tensor([slot]), device)
        floats = host_to_device(torch.tensor([[params.temperature, params.top_p, 1.0 - params.top_p,
                                               params.repetition_penalty, params.presence_penalty,
                                               params.frequency_penalty]], dtype=torch.float32), device)
        for column, t in enumerate((self.temperature, self.top_p, self.top_p_tail, self.repetition, self.presence,
                                    self.frequency)):
            t.index_copy_(0, at, floats[:, column])
        longs = host_to_device(torch.tensor([params.top_k, key]), device)
        self.top_k.index_copy_(0, at, longs[:1])
        self.keys.index_copy_(0, at, longs[1:])
        row = prompt + [self.pad_token_id] * (self.sequence.shape[1] - len(prompt))
        self.sequence.index_copy_(0, at, host_to_device(torch.tensor([row]), device))
        self.counts.index_fill_(0, at, 0.0)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` takes what row ``src`` held (compaction of the slots)."""
        device = self.temperature.device
        src_at, dst_at = host_to_device(torch.tensor([src]), device), host_to_device(torch.tensor([dst]), device)
        for t in self._tensors:
            t.index_copy_(0, dst_at, t.index_select(0, src_at))


class RowFlags:
    """Which processors any running row uses (host booleans, from the rows' host params)."""

    def __init__(self, params_list):
        self.sample = any(p.sampling for p in params_list)
        self.repetition = any(p.repetition_penalty != 1.0 for p in params_list)
        self.openai_penalties = any(p.presence_penalty or p.frequency_penalty for p in params_list)
        self.top_k = any(p.sampling and p.top_k for p in params_list)
        # The largest k of the sampled rows, for processors.top_k's top-k in place of a sort; None
        # keeps the sort (every_processor: one shape whatever the mix of requests).
        self.top_k_most = max((p.top_k for p in params_list if p.sampling), default=0)
        self.top_p = any(p.sampling and p.top_p < 1.0 for p in params_list)
        self.logprobs = max((p.logprobs for p in params_list if p.logprobs is not None), default=None)

    def every_processor(self) -> "RowFlags":
        """Every processor on (neutral values leave a row's choice bit-identical): the ops of a
        choice then depend on the batch bucket alone, not on the mix of requests, which lazy mode
        on a Gaudi would otherwise compile once per mix."""
        self.sample = self.repetition = self.openai_penalties = self.top_k = self.top_p = True
        self.top_k_most = None
        return self


def choose_tokens(logits: torch.Tensor, opts: RowOptions, b: int, used: torch.Tensor, steps: torch.Tensor,
                  flags: RowFlags, noise_kernel: UniformKernel | None = None) -> torch.Tensor:
    """Next token of rows 0..b-1. logits [b, V] float (raw); used [b]: tokens the row holds
    (prompt + generated, = the slot of the token chosen now); steps [b]: tokens the row has
    generated (its sampling step). Returns [b] long. The processors and the draw are
    ``search/processors.py``'s and ``search/sampling.py``'s, given per-row tensors (the noise by
    ``noise_kernel`` where the runtime has one: ``Generator.noise_kernel``)."""
    scores = logits
    if flags.repetition:
        scores = repetition_penalty(scores, opts.sequence[:b], used, opts.repetition[:b, None])
    if flags.openai_penalties:  # OpenAI's, over the generated tokens only: the server's alone
        counts = opts.counts[:b]
        scores = scores - opts.frequency[:b, None] * counts - opts.presence[:b, None] * (counts > 0)
    greedy = argmax_rows(scores)
    if not flags.sample:
        return greedy
    sampled_rows = opts.temperature[:b] > 0
    # Greedy rows divide by 1 (exact) and their draw is thrown away below.
    scores = temperature(scores, torch.where(sampled_rows, opts.temperature[:b], 1.0)[:, None])
    if flags.top_k:
        scores = top_k(scores, opts.top_k[:b], 1, flags.top_k_most)
    if flags.top_p:
        scores = top_p(scores, opts.top_p[:b, None], 1, tail=opts.top_p_tail[:b, None])
    return torch.where(sampled_rows, draw(scores, opts.keys[:b], steps, noise_kernel), greedy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """The model's log-probs (log_softmax of the raw logits, as the batch runner reports them) of
    the chosen tokens [b] and the ``top`` best [b, top] (values, ids)."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    values, ids = logp.topk(max(top, 1), dim=-1)
    return chosen, values[:, :top], ids[:, :top]
