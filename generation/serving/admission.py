"""Queued requests into free slots, between two steps, first come first served.

* **Prefill when idle.** When no row is running, nobody waits: waiting requests are prefilled up
  to ``max_prefill`` together as one [k, P] step (k a power of two, filler rows making up the
  rest; P the length bucket of the longest) while the padding wastes little (``PREFILL_WASTE``),
  and each prompt's slots are copied into its rows. A request that finds the engine idle first
  waits for the rest of a burst (``burst_wait_ms``), so that all of it is prefilled and its rows
  start together; what arrives during those prefills joins them.
* **Prompts join in segments inside the decode step.** While rows run, a waiting request takes its
  slots at once, and its prompt is fed inside the running rows' decode step (``DeviceRows.mixed``,
  called by the engine with ``next_segments``), up to ``prefill_chunk`` tokens per step in
  fixed-length segments: one read of the weights serves both, and no running row stalls for an
  arrival. The joining prompts fill the segments first come first served, so one step carries
  several short prompts or several pieces of a long one, and a longer prompt is spread over several
  steps; a row samples its first token after its last segment ran (``begin``). A request's other
  rows (sampled copies) take the prompt's slots from its first row when it is complete.
* **Other searches** (beams, ``best_of > n``, echo with log-probs...: ``Engine.submit_offline``)
  are answered when they reach the head of the queue, in a batch of their own (``answer_offline``).
* **LoRA adapters**: requests prefilled together share one adapter; each row's adapter index is
  written when it joins (``DeviceRows.place``) and moves with it.
* **The prefix cache**: a prefill group copies what the pool holds of its prompts; a prompt that
  joins in segments first copies its held blocks into its row and is fed from there; a prompt in
  place is stored (``DeviceRows.copy_prefix``, ``store_prefix``). ``handle.cached_tokens`` counts
  what the pool served, for the usage.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

import torch

from bloom_hpu.runtime.transfer import host_to_device

from ..run.logprobs import TokenText
from ..search.sampling import resolve_seed, row_keys
from ..search.text_ends import IncrementalText
from .device_rows import DeviceRows
from .handles import RequestHandle, Row
from .params import Event
from .row_options import RowOptions
from .slots import Slots

# Prompts prefilled together are padded to the longest, and to a prefill bucket's rows: a group
# grows only while the tokens computed stay within this factor of its real (bucketed) tokens. Each
# prefill call reads every weight once more, which costs as much as some hundred padded prompt
# tokens on a 2-core CPU (more on a card), so one call padded up to 2x beats two calls.
PREFILL_WASTE = 2.0
# An idle engine that receives a request takes what else arrives until nothing has come for
# EngineConfig.burst_wait_ms (at most BURST_WAIT_S in all): a burst of requests is then prefilled in
# groups, its rows starting together, where otherwise the first would run alone and the rest join it
# through mixed steps, piece by piece, each such step stalling the rows already running.
BURST_WAIT_S = 0.06

# (slot, its row, first prompt position, the prompt ids) of one segment of a mixed step
Segment = tuple[int, Row, int, list[int]]


class Admission:
    """The queue (``inbox``, filled by ``Engine.submit`` from any thread; ``waiting``, the
    scheduler's) and the rows whose prompts join in segments (``joining``)."""

    def __init__(self, config, slots: Slots, device_rows: DeviceRows, opts: RowOptions, logits: torch.Tensor,
                 text_of: TokenText, backend, device, stats: dict, wake: threading.Event,
                 answer_offline: Callable[[RequestHandle], None]):
        self.config = config
        self.device = device
        self.slots = slots
        self.device_rows = device_rows
        self.opts = opts
        self.logits = logits  # [R, V] the engine's: each row's logits for its next choice
        self.text_of = text_of
        self.backend = backend
        self.stats = stats  # the engine's: prefills, prompts_prefilled
        self.wake = wake  # set by Engine.submit
        self.answer_offline = answer_offline
        self.inbox: queue.Queue = queue.Queue(maxsize=config.max_queue)
        self.waiting: deque[RequestHandle] = deque()
        self.joining: deque[Row] = deque()  # first rows of requests whose prompt is fed in chunks, in order

    @property
    def queue_length(self) -> int:
        return self.inbox.qsize() + len(self.waiting)

    def admit(self) -> bool:
        """Move queued requests into free slots, first come first served, prefilling up to
        ``max_prefill`` of them together. Returns whether an offline request ran."""
        # No row running: no one waits for a prefill, which is faster than chunks for a burst.
        idle = self.slots.idle()
        if idle and self.config.burst_wait_ms > 0 and not self.waiting and not self.inbox.empty():
            self._await_burst()
        self._take_arrivals()
        ran = False
        while self.waiting:
            handle = self.waiting[0]
            if handle.cancelled.is_set():
                self.waiting.popleft()
                continue
            if handle.offline is not None:
                self.waiting.popleft()
                self.answer_offline(handle)
                ran = True
                continue
            if not idle:  # rows run: the prompt joins in chunks inside their decode steps
                if handle.params.rows > len(self.slots.free()):
                    break
                self.waiting.popleft()
                self._seat_joining(handle)
                continue
            group = self._next_group()
            if not group:
                break
            for _ in group:
                self.waiting.popleft()
            self._join_group(group)
            # No row has chosen a token yet: what arrived during that prefill joins the burst too
            # (a client late by more than burst_wait_ms), rather than the running rows' steps later.
            self._take_arrivals()
        return ran

    def _take_arrivals(self) -> None:
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _await_burst(self) -> None:
        """Wait while requests keep arriving (``burst_wait_ms``, ``BURST_WAIT_S``): ``submit`` sets
        ``wake``."""
        deadline = time.perf_counter() + BURST_WAIT_S
        while time.perf_counter() < deadline:
            self.wake.clear()
            if not self.wake.wait(self.config.burst_wait_ms / 1000):
                return

    # --- an idle engine: prefill groups ----------------------------------------------------------

    def _next_group(self) -> list[RequestHandle]:
        """The requests at the head of the queue to prefill together: consecutive ones that fit
        the free slots, at most ``max_prefill``, while the [k, P] step that runs them (k their
        prefill bucket, filler rows included; P the longest one's length bucket) computes at most
        PREFILL_WASTE times the tokens of their own length buckets."""
        free, most = len(self.slots.free()), self.device_rows.prefill_sizes[-1]
        group, rows, real, longest, held = [], 0, 0, 0, False
        for handle in self.waiting:
            if handle.offline is not None or handle.cancelled.is_set() or len(group) == most:
                break
            if group and handle.params.adapter != group[0].params.adapter:  # a prefill runs one adapter
                break
            # Prompts the prefix cache holds apart from those it does not: a group with one miss
            # among hits would copy nothing (its rests would need the whole length: prefixed.py).
            hit = self.device_rows.holds_prefix(handle.prompt_ids, handle.params.adapter)
            if group and hit != held:
                break
            held = hit
            length = self.device_rows.length_bucket(len(handle.prompt_ids))
            computed = self.device_rows.prefill_size(len(group) + 1) * max(longest, length)
            if rows + handle.params.rows > free or (group and computed > PREFILL_WASTE * (real + length)):
                break
            group.append(handle)
            rows += handle.params.rows
            real += length
            longest = max(longest, length)
        return group

    def _join_group(self, group: list[RequestHandle]) -> None:
        try:
            self._join(group)
        except Exception as error:
            self.slots.unseat(group)
            if len(group) == 1:  # this request fails alone; the running rows go on
                group[0].emit(Event("error", message=f"internal error: {error!r}"))
                return
            for handle in group:  # find the one that fails: each alone
                self._join_group([handle])

    def _join(self, group: list[RequestHandle]) -> None:
        free = self.slots.free()
        seats, start = [], 0
        for handle in group:
            seats.append(free[start : start + handle.params.rows])
            start += handle.params.rows
        self.slots.fit([s for slots in seats for s in slots])
        logits = self.device_rows.prefill([h.prompt_ids for h in group], group[0].params.adapter)  # [k, V]
        self.stats["prefills"] += 1
        self.stats["prompts_prefilled"] += len(group)
        extent = self.device_rows.length_bucket(max(len(h.prompt_ids) for h in group))
        k = self.device_rows.prefill_size(len(group))
        for handle, cached in zip(group, self.device_rows.last_cached):
            handle.cached_tokens = cached
        for row, (handle, slots) in enumerate(zip(group, seats)):
            self.device_rows.place(k, row, self.slots.bucket, slots, extent, handle.params.adapter)
            self._seat(handle, slots, logits.index_select(0, host_to_device(torch.tensor([row]), self.device)))
        self.backend.mark_step()

    def _seat(self, handle: RequestHandle, slots: list[int], logits: torch.Tensor) -> None:
        """The request's rows take ``slots`` with its prompt in place: host state, then ``_start``."""
        for copy, slot in enumerate(slots):
            self.slots.rows[slot] = self._new_row(handle, copy, len(handle.prompt_ids))
        self._start(slots, logits)

    def _new_row(self, handle: RequestHandle, copy: int, prompt_done: int, copy_of: Row | None = None) -> Row:
        params, length = handle.params, len(handle.prompt_ids)
        limit = min(params.max_tokens, self.config.max_length - length)
        indices = [copy] if params.sampling else list(range(params.n))
        return Row(handle, indices, length, limit, IncrementalText(self.text_of.token_bytes, params.stop),
                   prompt_done=prompt_done, copy_of=copy_of)

    def _start(self, slots: list[int], logits: torch.Tensor) -> None:
        """The rows in ``slots`` (one request's, prompt in place) start: options, sampling keys,
        first logits ``logits`` [1, V]."""
        handle = self.slots.rows[slots[0]].handle
        params, ids = handle.params, handle.prompt_ids
        if params.sampling:
            # The keys Generator.generate gives this prompt alone: the same seed samples the same text.
            keys = row_keys([ids], resolve_seed(params.seed), params.rows, "cpu").tolist()
        else:
            keys = [0] * len(slots)
        for slot in slots:
            copy = self.slots.rows[slot].indices[0]
            self.logits.index_copy_(0, host_to_device(torch.tensor([slot]), self.device), logits.to(self.logits.dtype))
            self.opts.set_row(slot, params, keys[copy] if params.sampling else 0, ids)

    # --- rows running: prompts in segments ------------------------------------------------------

    def _seat_joining(self, handle: RequestHandle) -> None:
        """The request takes free slots now; its prompt is fed in segments into the first."""
        free = self.slots.free()[: handle.params.rows]
        lead = self._new_row(handle, 0, 0)
        self.slots.rows[free[0]] = lead
        for copy, slot in enumerate(free[1:], start=1):
            self.slots.rows[slot] = self._new_row(handle, copy, 0, copy_of=lead)
        self.joining.append(lead)
        self.slots.fit()
        # What the prefix cache holds of the prompt goes into the row now; segments feed the rest.
        lead.prompt_done = handle.cached_tokens = self.device_rows.copy_prefix(
            self.slots.bucket, free[0], handle.prompt_ids, handle.params.adapter)
        self.stats["joined_after_a_hit"] += lead.prompt_done > 0

    def next_segments(self) -> list[Segment]:
        """The next pieces of the joining prompts (first come first served) that one mixed step
        carries: (slot, row, start, ids) each, a prompt's pieces in order, as many as fit."""
        while self.joining and self._seated_joining(self.joining[0]) is None:
            self.joining.popleft()  # cancelled, failed, or complete
        length, most = self.device_rows.segment_length, self.device_rows.segment_counts[-1]
        segments = []
        for row in list(self.joining):
            slot = self._seated_joining(row)
            if slot is None:
                continue
            for start in range(row.prompt_done, row.prompt_len, length):
                if len(segments) == most:
                    return segments
                segments.append((slot, row, start, row.handle.prompt_ids[start : start + length]))
        return segments

    def _seated_joining(self, row: Row) -> int | None:
        """The slot of ``row`` if it still sits there with its prompt unfinished, else None."""
        slot = self.slots.slot_of(row)
        return slot if slot is not None and not row.running else None

    def begin(self, lead: Row, logits: torch.Tensor) -> None:
        """``lead``'s prompt is complete (``logits`` [1, V] its last token's): the request's other
        rows take its slots, and all of them start."""
        rows = self.slots.rows
        lead_slot = next(i for i, r in enumerate(rows) if r is lead)  # by identity: rows are dataclasses
        ids = lead.handle.prompt_ids
        self.device_rows.store_prefix(self.slots.bucket, lead_slot, ids, len(ids), lead.handle.params.adapter)
        slots = [lead_slot]
        extent = self.slots.extent()
        for slot, row in enumerate(rows):
            if row is not None and row.copy_of is lead:
                self.device_rows.move(self.slots.bucket, lead_slot, slot, extent)
                row.prompt_done, row.copy_of = row.prompt_len, None
                slots.append(slot)
        self._start(slots, logits)
