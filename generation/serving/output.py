"""What the chosen tokens become: each running row's text, its events and its end.

Each step the chosen tokens [b] (with their log-probs where a row asked for them) come to the host
in one transfer (``to_host``: the step's one sync); streaming, EOS, stop strings and budgets are
decided there. A row gives out ids with the text they spell once no stop string can still claim it
(``search/text_ends.IncrementalText``). A finished row's sequence is made as offline
(``results.make_sequence``: EOS, stop strings), each choice it answers gets a "finish" event, the
request a "done" event once all its choices finished, and the row's slot is freed.
"""

from __future__ import annotations

import time

import torch

from ..run.results import make_sequence
from .handles import Row
from .params import Event, TokenLogprob
from .slots import Slots


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """The model's log-probs (log_softmax of the raw logits, as the batch runner reports them) of
    the chosen tokens [b] and the ``top`` best [b, top] (values, ids)."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    values, ids = logp.topk(max(top, 1), dim=-1)
    return chosen, values[:, :top], ids[:, :top]


def to_host(logits: torch.Tensor, tokens: torch.Tensor, top: int | None) -> list[list]:
    """Row i's [token] or, with ``top`` (the most log-probs a running row asked for),
    [token, its log-prob, top values..., top ids...]: the step's one host sync."""
    if top is None:
        return [[t] for t in tokens.tolist()]
    # Tokens and log-probs in one transfer: [b, 2 + 2k] float64 (ids < 2**53 stay exact).
    chosen, values, ids = token_logprobs(logits, tokens, top)
    return torch.cat([tokens[:, None].double(), chosen[:, None].double(), values.double(), ids.double()],
                     dim=1).tolist()


class Output:
    """Hands each running row's new token out to its request (``RequestHandle.emit``)."""

    def __init__(self, slots: Slots, tokenizer, metrics):
        self.slots = slots
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.metrics = metrics

    def hand_out(self, live: list[int], host: list[list], top: int | None) -> None:
        """The rows in slots ``live`` chose ``host[slot]`` (``to_host``'s rows)."""
        k = top or 0
        now = time.perf_counter()
        for i in live:
            token = int(host[i][0])
            lp = None
            if top is not None:
                ranked = [(int(t), v) for t, v in zip(host[i][2 + k :], host[i][2 : 2 + k])]
                lp = TokenLogprob(token, host[i][1], ranked)
            self.advance(i, token, lp, now)

    def advance(self, slot: int, token: int, lp: TokenLogprob | None, now: float) -> None:
        """Row ``slot`` chose ``token``: stream what may be given out, end the row if it is done."""
        row = self.slots.rows[slot]
        handle, stops = row.handle, row.handle.params.stop
        if handle.first_token_at is None:
            handle.first_token_at = now
            self.metrics.first_token(now - handle.submitted)
        elif row.ids:
            self.metrics.inter_token(now - row.last_time)
        row.last_time = now
        row.ids.append(token)
        row.pending.append(lp)
        # Structured output: the grammar's end ends the row (finish reason "stop").
        grammar_ended = row.grammar is not None and row.grammar.consume(token)
        eos = token == self.eos and not handle.params.ignore_eos
        if not eos:
            row.out.add(token)
        reason = ("eos" if eos else "stop" if row.out.stopped or grammar_ended
                  else "length" if len(row.ids) >= row.limit else None)
        if reason is None:
            piece = row.out.take()
            if piece:
                # Ids go out with the text they spell, once no stop string can still claim it.
                self._send(row, piece, len(row.ids) - row.ids_given if row.out.all_given else 0)
            return
        # The finished sequence is the truth (text_ends: EOS, stop strings), as offline.
        sequence = make_sequence(self.tokenizer, row.ids, reason, stops=stops, eos_ends=not handle.params.ignore_eos)
        self._send(row, sequence.text[row.out.given :], max(0, len(sequence.token_ids) - row.ids_given))
        for index in row.indices:
            handle.sequences[index] = sequence
            handle.emit(Event("finish", index=index, finish_reason=sequence.finish_reason, sequence=sequence))
        # A client's next request resends this conversation: keep its blocks (all but the last
        # token's keys and values are in the row).
        device_rows = self.slots.device_rows
        device_rows.store_prefix(self.slots.bucket, slot, handle.prompt_ids + row.ids,
                                 len(handle.prompt_ids) + len(row.ids) - 1, handle.params.adapter)
        self.slots.rows[slot] = None
        if len(handle.sequences) == handle.params.n:
            completion = sum(len(s.token_ids) for s in handle.sequences.values())
            usage = {"prompt_tokens": len(handle.prompt_ids), "completion_tokens": completion,
                     "total_tokens": len(handle.prompt_ids) + completion}
            if device_rows.pool is not None:  # as OpenAI reports its own prompt caching
                usage["prompt_tokens_details"] = {"cached_tokens": handle.cached_tokens}
            handle.emit(Event("done", usage=usage))

    def _send(self, row: Row, text: str, count: int) -> None:
        ids = row.ids[row.ids_given : row.ids_given + count]
        lps = row.pending[:count]
        del row.pending[:count]
        row.ids_given += count
        if not text and not ids:
            return
        logprobs = lps if row.handle.params.logprobs is not None else None
        for index in row.indices:
            row.handle.emit(Event("delta", index=index, text=text, token_ids=ids, logprobs=logprobs))
