"""Per-row options as device tensors, indexed by slot: what ``search/choose.choose_rows`` reads to
choose the next token of a whole batch of mixed requests.

Every option a request may set is one entry of a [max_batch] tensor, so a batch that mixes greedy
and sampled rows, temperatures, top-k/top-p and penalties runs the very same ops on the same
shapes; nothing splits the batch. Whole processors are skipped when no running row uses them
(``choose.RowFlags``: a host-known fact from admission, not a read-back from the device).
"""

from __future__ import annotations

import torch

from bloom_hpu.runtime.transfer import host_to_device


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

    def record(self, b: int, used: torch.Tensor, tokens: torch.Tensor, repetition: bool, counts: bool) -> None:
        """Rows 0..b-1 chose ``tokens`` [b] at slots ``used`` [b]: the token history the repetition
        penalty reads, and the counts of OpenAI's penalties (free rows, ``used`` 0, count nothing),
        each kept only while some running row uses it (``choose.RowFlags``)."""
        if repetition:
            self.sequence[:b].scatter_(1, used.clamp(max=self.sequence.shape[1] - 1)[:, None], tokens[:, None])
        if counts:
            running = (used > 0).float()
            self.counts[:b].scatter_add_(1, tokens[:, None], running[:, None])

    def record_verified(self, b: int, used: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor,
                        repetition: bool, counts: bool) -> None:
        """``record`` for a verify pass: rows 0..b-1 chose tokens [b, S] at slots used + 0.. S-1 and
        keep the first ``kept`` [b] (the tokens a row keeps past its end are never read: its slot
        is set anew before another request uses it)."""
        s = tokens.shape[1]
        j = torch.arange(s, device=tokens.device)
        if repetition:
            slots = (used[:, None] + j).clamp(max=self.sequence.shape[1] - 1)
            self.sequence[:b].scatter_(1, slots, tokens)
        if counts:
            keep = ((j[None, :] < kept[:, None]) & (used[:, None] > 0)).float()
            self.counts[:b].scatter_add_(1, tokens, keep)
