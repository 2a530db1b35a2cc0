"""The serving engine: continuous batching over a fixed set of rows, in static shapes. No HTTP.

* **Slots.** ``max_batch`` rows. A request takes ``params.rows`` free slots (sampled choices one row
  each; greedy choices are all alike, so one row serves them) and gives them back when it ends.
* **Caches and steps** live in ``device_rows.py``: one KV cache per batch bucket, allocated once,
  and the steps, called with host values only (so a tensor-parallel server can send each call to
  every rank: ``tp_serving.py``). Decode runs over the smallest bucket that holds every running row,
  so its cost follows the number of active rows, not ``max_batch``. Running rows are kept in the
  lowest slots (a finished row's place is taken by the highest one), and when the bucket changes
  their live slots move to the other bucket's cache.
* **Prompts join in segments inside the decode step.** While rows run, a waiting request takes its
  slots at once, and its prompt is fed inside the running rows' decode step (``DeviceRows.mixed``),
  up to ``prefill_chunk`` tokens per step in fixed-length segments: one read of the weights serves
  both, and no running row stalls for an arrival. The joining prompts fill the segments first come
  first served, so one step carries several short prompts or several pieces of a long one, and a
  longer prompt is spread over several steps; a row samples its first token after its last segment
  ran. A request's other rows (sampled copies) take the prompt's slots from its first row when it
  is complete.
* **Prefill when idle.** When no row is running, nobody waits: waiting requests are prefilled as
  before, up to ``max_prefill`` together as one [k, P] step (k a power of two, filler rows making up
  the rest; P the length bucket of the longest) while the padding wastes little, and each prompt's
  slots are copied into its rows. A request that finds the engine idle first waits for the rest of a
  burst (``burst_wait_ms``), so that all of it is prefilled and its rows start together; what
  arrives during those prefills joins them.
* **Decode.** Each step chooses every running row's next token (per-row options as tensors:
  ``row_options.py``), copies the [b] tokens to the host (the step's one sync: streaming, EOS,
  stop strings and budgets are decided there), then runs one [b, 1] decode in the bucket's cache
  (with prompt segments in it when prompts are joining) with each row at its own position and a
  window that is the length bucket of the furthest slot.
* **Warm-up** runs every (prefill bucket, length bucket), (batch bucket, window) and (batch bucket,
  window, segment count) once, so after it no load adds a step signature (``backend.signatures``).
* **Scheduling.** One thread owns the model. Requests arrive through a thread-safe queue and join
  between steps, first come first served; events stream back through each request's sink.
* **LoRA adapters** (``bloom_hpu/lora_rows.py``, when the generator serves some): requests
  prefilled together share one adapter; each row's adapter index is written when it joins and
  moves with it (``DeviceRows.place`` / ``move``); an offline answer runs with every row reading
  its request's adapter.
* **Other searches.** Beam search, ``best_of > n``, ``echo`` with log-probs, ``max_tokens`` 0 and
  ``no_repeat_ngram_size`` are answered by the batch runner's path (``jobs.runner.answer_batch``
  over ``Generator.generate``) in a batch of their own, between two steps. Those use the
  generator's own shapes, not the engine's.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from bloom_hpu.runtime.transfer import host_to_device

from ..logprobs import TokenText
from ..results import make_sequence
from ..search.choose import RowFlags, choose_rows
from ..search.sampling import resolve_seed, row_keys
from ..search.text_ends import IncrementalText
from .device_rows import DeviceRows
from .heap import freeze_long_lived
from .params import Event, SamplingParams, TokenLogprob
from .row_options import RowOptions, token_logprobs


class EngineError(ValueError):
    """A request the engine cannot take (prompt too long, too many rows...); message for the user,
    ``param`` the request field it is about."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class QueueFull(Exception):
    """The engine's queue holds ``max_queue`` requests already."""


@dataclass
class EngineConfig:
    max_batch: int = 8
    max_length: int = 128
    bucket_width: int = 32  # length buckets (prompt padding, decode windows); 0: max_length only
    max_queue: int = 256
    max_prefill: int = 4  # prompts prefilled together in one step (when no row is running)
    prefill_chunk: int = 64  # prompt tokens fed per decode step while rows run (in segments)
    burst_wait_ms: float = 8.0  # idle engine: gather arrivals until none came for this long (0: off)


class EngineMetrics:
    """What the engine reports as it runs; the app backs it with Prometheus. No-ops here."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def tokens(self, count: int) -> None: ...


_ids = itertools.count(1)


class RequestHandle:
    """One request inside the engine. Events go to ``sink`` (called from the scheduler thread), or,
    without one, to a queue read by ``events()``. ``cancel()`` frees its rows at the next step."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink=None, offline=None):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.offline = offline  # a jobs.requests.Request for the batch runner's path, or None
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._queue: queue.Queue | None = queue.Queue() if sink is None else None
        self._sink = sink or self._queue.put
        self.sequences: dict[int, object] = {}  # choice index -> finished Sequence

    def emit(self, event: Event) -> None:
        try:
            self._sink(event)
        except Exception:  # a consumer that is gone (e.g. its event loop closed): stop its rows
            self.cancel()

    def cancel(self) -> None:
        self.cancelled.set()

    def events(self, timeout: float | None = None):
        """Events until the last one ("done", "record" or "error"); only without a sink."""
        while True:
            event = self._queue.get(timeout=timeout)
            yield event
            if event.kind in ("done", "record", "error"):
                return

    def result(self, timeout: float | None = None) -> list:
        """The finished sequences, by choice index (blocks; only without a sink)."""
        for event in self.events(timeout):
            if event.kind == "error":
                raise EngineError(event.message)
        return [self.sequences[i] for i in sorted(self.sequences)]


@dataclass
class _Row:
    """Host state of one running row."""

    handle: RequestHandle
    indices: list[int]  # the choices this row answers (greedy: all n of them)
    prompt_len: int
    limit: int  # new tokens it may produce
    out: IncrementalText  # its text so far (EOS excluded) and how much was sent
    ids: list[int] = field(default_factory=list)
    ids_given: int = 0  # token ids already sent
    pending: list = field(default_factory=list)  # TokenLogprob of ids not yet sent
    last_time: float = 0.0
    # Joining in chunks: prompt tokens in this row's slots so far (prompt_len once it runs), and
    # for a request's other rows, its first row, whose slots they take when its prompt is complete.
    prompt_done: int = 0
    copy_of: "_Row | None" = None

    @property
    def running(self) -> bool:
        return self.prompt_done >= self.prompt_len

    @property
    def written(self) -> int:
        """Slots of its row written so far (at most)."""
        return self.prompt_len + len(self.ids) if self.running else self.prompt_done


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


class Engine:
    def __init__(self, generator, config: EngineConfig = EngineConfig(), metrics: EngineMetrics | None = None,
                 device_rows: DeviceRows | None = None):
        self.generator = generator
        self.config = config
        self.metrics = metrics or EngineMetrics()
        self.tokenizer = generator.tokenizer
        self.text_of = TokenText(self.tokenizer)
        self.device = generator.device
        self.pad = self.tokenizer.pad_token_id
        self.lora = getattr(generator, "lora", None)  # ServedAdapters, or None
        self.eos = self.tokenizer.eos_token_id
        self.device_rows = device_rows or DeviceRows(generator, config.max_batch, config.max_length,
                                                     config.bucket_width, config.max_prefill, config.prefill_chunk)
        self.batch_sizes = self.device_rows.batch_sizes
        self.prefill_sizes = self.device_rows.prefill_sizes
        self.lengths = self.device_rows.lengths
        vocab = generator.runner.model.config.vocab_size
        self.logits = torch.zeros(config.max_batch, vocab, dtype=torch.float32, device=self.device)  # [R, V]
        self.opts = RowOptions(config.max_batch, vocab, config.max_length, self.device, self.pad)
        self.rows: list[_Row | None] = [None] * config.max_batch
        self.bucket = 0  # batch bucket of the running rows (0: none)
        self.inbox: queue.Queue = queue.Queue(maxsize=config.max_queue)
        self.waiting: deque[RequestHandle] = deque()
        self.joining: deque[_Row] = deque()  # first rows of requests whose prompt is fed in chunks, in order
        self.ready = threading.Event()
        self.warmup_report: dict | None = None
        self.tokens_total = 0
        # What the scheduler did, for tests and the benchmark: most rows at once, rows moved to
        # lower slots, batch-bucket changes, prefill steps and the prompts they held, mixed steps
        # (decodes with a prompt chunk) and the prompts that joined that way.
        self.stats = {"peak_rows": 0, "row_moves": 0, "bucket_changes": 0, "prefills": 0, "prompts_prefilled": 0,
                      "mixed_steps": 0, "prompts_chunked": 0}
        # Called once a step, after its events are handed out (the app: wait, briefly, until its
        # event loop has sent them). On the CPU before the decode, so that the loop and the decode's
        # threads do not compete for the cores; on a card after the decode is launched, so that the
        # loop sends while the card computes.
        self.flush_events = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the outside: submit, state, start/stop -------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink=None) -> RequestHandle:
        """Queue one prompt; raises EngineError for what can never run and QueueFull."""
        self._check(prompt_ids)
        if params.rows > self.config.max_batch:
            raise EngineError(f"n={params.n} sampled choices need {params.rows} rows; "
                              f"the server runs at most {self.config.max_batch} (--max_batch)", "n")
        if params.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1", "max_tokens")
        self._check_adapter(params.adapter)
        return self._enqueue(RequestHandle(list(prompt_ids), params, sink))

    def submit_offline(self, request, prompt_ids: list[list[int]], sink=None, adapter: int = 0) -> RequestHandle:
        """A jobs.requests.Request answered by the batch runner's path (beams, best_of, echo with
        log-probs...); its one event is a "record". ``adapter``: as ``SamplingParams.adapter``."""
        for ids in prompt_ids:
            self._check(ids)
        self._check_adapter(adapter)
        if adapter and len(prompt_ids) * request.rows_per_prompt > self.lora.rows.capacity:
            raise EngineError(f"this search needs {len(prompt_ids) * request.rows_per_prompt} rows; with a LoRA "
                              f"adapter at most {self.lora.rows.capacity} can run at once", "n")
        return self._enqueue(RequestHandle(prompt_ids[0], SamplingParams(adapter=adapter), sink, offline=request))

    def _check_adapter(self, adapter: int) -> None:
        served = len(self.lora.names) if self.lora is not None else 0
        if not 0 <= adapter <= served:
            raise EngineError(f"no LoRA adapter {adapter}: the server has {served}", "model")


    def _check(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise EngineError("the prompt is empty: nothing to continue from")
        if len(prompt_ids) >= self.config.max_length:
            raise EngineError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room for new tokens "
                              f"under the server's max_length {self.config.max_length}")

    def _enqueue(self, handle: RequestHandle) -> RequestHandle:
        try:
            self.inbox.put_nowait(handle)
        except queue.Full:
            raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting)") from None
        self._wake.set()
        return handle

    @property
    def queue_length(self) -> int:
        return self.inbox.qsize() + len(self.waiting)

    @property
    def running_rows(self) -> int:
        return sum(r is not None for r in self.rows)

    def start(self, warm_up: bool = True) -> None:
        """Warm up (in the scheduler thread, so a server can answer /health meanwhile), then serve."""
        self._thread = threading.Thread(target=self._run, args=(warm_up,), name="bloom-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.device_rows.close()

    def _run(self, warm_up: bool) -> None:
        if warm_up:
            self.warm_up()
        freeze_long_lived()  # a full garbage collection over the model's objects would stall a step
        self.ready.set()
        while not self._stopping.is_set():
            # Cleared before looking for work: a submit after this point wakes the wait below.
            self._wake.clear()
            try:
                busy = self.step()
            except Exception as error:  # never let one bad step end the server
                self._fail_all(f"internal error: {error!r}")
                busy = False
            if not busy:
                self.device_rows.idle()
                self._wake.wait(timeout=0.5)

    # --- warm-up --------------------------------------------------------------------------------

    def warm_up(self) -> dict:
        """Run every step shape the engine uses (``DeviceRows.warm_up``)."""
        self.warmup_report = self.device_rows.warm_up()
        return self.warmup_report

    # --- one scheduler step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> bool:
        """Admit what fits, choose a token for every running row, hand out the results, decode.
        Returns False when there was nothing to do."""
        self._drop_cancelled()
        ran_offline = self._admit()
        if all(r is None for r in self.rows):
            return ran_offline
        live = [i for i, r in enumerate(self.rows) if r is not None and r.running]
        if live:
            self._choose(live)
        self._compact()
        overlap = self.generator.backend.asynchronous_steps
        if self.flush_events is not None and not overlap:
            self.flush_events()
        self._decode()
        if self.flush_events is not None and overlap:
            self.flush_events()
        return True

    def _choose(self, live: list[int]) -> None:
        """Choose the next token of the running rows ``live`` and hand out what they give."""
        b = self.bucket
        rows = [r if r is not None and r.running else None for r in self.rows[:b]]  # joining rows count as free
        used, steps = self.device_rows.upload([r.prompt_len + len(r.ids) if r else 0 for r in rows],
                                   [len(r.ids) if r else 0 for r in rows])
        params = [self.rows[i].handle.params for i in live]
        flags = RowFlags(params)
        if self.generator.backend.compiles_eager_ops:
            flags.every_processor()
        logits = self.logits[:b]
        tokens = choose_rows(logits, self.opts, b, used, steps, flags, self.generator.noise_kernel)  # [b]
        self.opts.record(b, used, tokens, flags.repetition, flags.openai_penalties)
        top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if top is None:
            host = [[t] for t in tokens.tolist()]  # the step's one host sync
        else:
            # Tokens and log-probs in one transfer: [b, 2 + 2k] float64 (ids < 2**53 stay exact).
            chosen, values, ids = token_logprobs(logits, tokens, top)
            host = torch.cat([tokens[:, None].double(), chosen[:, None].double(), values.double(), ids.double()],
                             dim=1).tolist()
        self.generator.backend.mark_step()
        k = top or 0
        now = time.perf_counter()
        for i in live:
            token = int(host[i][0])
            lp = None
            if top is not None:
                top = [(int(t), v) for t, v in zip(host[i][2 + k :], host[i][2 : 2 + k])]
                lp = TokenLogprob(token, host[i][1], top)
            self._advance(i, token, lp, now)
        self.stats["peak_rows"] = max(self.stats["peak_rows"], len(live))
        self.tokens_total += len(live)
        self.metrics.tokens(len(live))

    def _decode(self) -> None:
        """One [b, 1] decode of every running row, with the next segments of joining prompts in it
        if any; its logits wait for the next step's choice."""
        if not self.bucket:
            return
        rows = self.rows[: self.bucket]
        # The token chosen last sits at slot prompt_len + generated - 1; free rows write slot 0. A
        # joining row writes a filler at the next slot of its prompt, which its next segment (or,
        # for a copy, its first row's slots) replaces before anything reads it.
        positions = [(r.prompt_len + len(r.ids) - 1 if r.running else r.prompt_done) if r else 0 for r in rows]
        tokens = [r.ids[-1] if r and r.running else self.pad for r in rows]
        segments = self._next_segments()
        if not segments:
            if not any(r is not None and r.running for r in rows):
                return  # only copies waiting for their first row: nothing to decode
            out = self.device_rows.decode(self.bucket, tokens, positions, self._length_bucket(max(positions) + 1))
            self.logits[: self.bucket].copy_(out)
            self.generator.backend.mark_step()
            return
        window = self._length_bucket(max(max(positions) + 1, max(start + len(ids) for _, _, start, ids in segments)))
        try:
            out = self.device_rows.mixed(self.bucket, tokens, positions, window,
                                         [(slot, start, ids, row.handle.params.adapter)
                                          for slot, row, start, ids in segments])
        except Exception as error:  # these requests fail alone; the running rows decode without them
            handles = list({id(row.handle): row.handle for _, row, _, _ in segments}.values())
            self._unseat(handles)
            for handle in handles:
                handle.emit(Event("error", message=f"internal error: {error!r}"))
            self._compact()
            self._decode()
            return
        self.stats["mixed_steps"] += 1
        self.logits[: self.bucket].copy_(out[: self.bucket])
        for s, (_, row, _, ids) in enumerate(segments):
            row.prompt_done += len(ids)
            if row.running:  # this segment ended its prompt: its logits are the first token's
                self.stats["prompts_chunked"] += 1
                self._begin(row, out[self.bucket + s : self.bucket + s + 1])
        self.generator.backend.mark_step()

    def _next_segments(self) -> list[tuple[int, _Row, int, list[int]]]:
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

    def _seated_joining(self, row: _Row) -> int | None:
        """The slot of ``row`` if it still sits there with its prompt unfinished, else None."""
        slot = next((i for i, r in enumerate(self.rows) if r is row), None)
        return slot if slot is not None and not row.running else None

    def _length_bucket(self, needed: int) -> int:
        return next(n for n in self.lengths if n >= needed)

    def _batch_bucket(self, rows: int) -> int:
        return next(b for b in self.batch_sizes if b >= rows)

    # --- rows joining -----------------------------------------------------------------------------

    def _admit(self) -> bool:
        """Move queued requests into free slots, first come first served, prefilling up to
        ``max_prefill`` of them together. Returns whether an offline request ran."""
        # No row running: no one waits for a prefill, which is faster than chunks for a burst.
        idle = all(r is None for r in self.rows)
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
                self._answer_offline(handle)
                ran = True
                continue
            if not idle:  # rows run: the prompt joins in chunks inside their decode steps
                if handle.params.rows > sum(r is None for r in self.rows):
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
        ``_wake``."""
        deadline = time.perf_counter() + BURST_WAIT_S
        while time.perf_counter() < deadline:
            self._wake.clear()
            if not self._wake.wait(self.config.burst_wait_ms / 1000):
                return

    def _next_group(self) -> list[RequestHandle]:
        """The requests at the head of the queue to prefill together: consecutive ones that fit
        the free slots, at most ``max_prefill``, while the [k, P] step that runs them (k their
        prefill bucket, filler rows included; P the longest one's length bucket) computes at most
        PREFILL_WASTE times the tokens of their own length buckets."""
        free = sum(r is None for r in self.rows)
        group, rows, real, longest = [], 0, 0, 0
        for handle in self.waiting:
            if handle.offline is not None or handle.cancelled.is_set() or len(group) == self.prefill_sizes[-1]:
                break
            if group and handle.params.adapter != group[0].params.adapter:  # a prefill runs one adapter
                break
            length = self._length_bucket(len(handle.prompt_ids))
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
            self._unseat(group)
            if len(group) == 1:  # this request fails alone; the running rows go on
                group[0].emit(Event("error", message=f"internal error: {error!r}"))
                return
            for handle in group:  # find the one that fails: each alone
                self._join_group([handle])

    def _unseat(self, group: list[RequestHandle]) -> None:
        self.rows = [None if r is not None and any(r.handle is h for h in group) else r for r in self.rows]

    def _join(self, group: list[RequestHandle]) -> None:
        free = [i for i, r in enumerate(self.rows) if r is None]
        seats, start = [], 0
        for handle in group:
            seats.append(free[start : start + handle.params.rows])
            start += handle.params.rows
        occupied = [i for i, r in enumerate(self.rows) if r is not None] + [s for slots in seats for s in slots]
        self._resize(self._batch_bucket(max(occupied) + 1))
        logits = self.device_rows.prefill([h.prompt_ids for h in group], group[0].params.adapter)  # [k, V]
        self.stats["prefills"] += 1
        self.stats["prompts_prefilled"] += len(group)
        extent = self._length_bucket(max(len(h.prompt_ids) for h in group))
        k = self.device_rows.prefill_size(len(group))
        for row, (handle, slots) in enumerate(zip(group, seats)):
            self.device_rows.place(k, row, self.bucket, slots, extent, handle.params.adapter)
            self._seat(handle, slots, logits.index_select(0, host_to_device(torch.tensor([row]), self.device)))
        self.generator.backend.mark_step()

    def _seat(self, handle: RequestHandle, slots: list[int], logits: torch.Tensor) -> None:
        """The request's rows take ``slots`` with its prompt in place: host state, then ``_start``."""
        for copy, slot in enumerate(slots):
            self.rows[slot] = self._new_row(handle, copy, len(handle.prompt_ids))
        self._start(slots, logits)

    def _new_row(self, handle: RequestHandle, copy: int, prompt_done: int, copy_of: _Row | None = None) -> _Row:
        params, length = handle.params, len(handle.prompt_ids)
        limit = min(params.max_tokens, self.config.max_length - length)
        indices = [copy] if params.sampling else list(range(params.n))
        return _Row(handle, indices, length, limit, IncrementalText(self.text_of.token_bytes, params.stop),
                    prompt_done=prompt_done, copy_of=copy_of)

    def _start(self, slots: list[int], logits: torch.Tensor) -> None:
        """The rows in ``slots`` (one request's, prompt in place) start: options, sampling keys,
        first logits ``logits`` [1, V]."""
        handle = self.rows[slots[0]].handle
        params, ids = handle.params, handle.prompt_ids
        if params.sampling:
            # The keys Generator.generate gives this prompt alone: the same seed samples the same text.
            keys = row_keys([ids], resolve_seed(params.seed), params.rows, "cpu").tolist()
        else:
            keys = [0] * len(slots)
        for slot in slots:
            copy = self.rows[slot].indices[0]
            self.logits.index_copy_(0, host_to_device(torch.tensor([slot]), self.device), logits.to(self.logits.dtype))
            self.opts.set_row(slot, params, keys[copy] if params.sampling else 0, ids)

    def _seat_joining(self, handle: RequestHandle) -> None:
        """The request takes free slots now; its prompt is fed in chunks into the first (``_decode``)."""
        free = [i for i, r in enumerate(self.rows) if r is None][: handle.params.rows]
        lead = self._new_row(handle, 0, 0)
        self.rows[free[0]] = lead
        for copy, slot in enumerate(free[1:], start=1):
            self.rows[slot] = self._new_row(handle, copy, 0, copy_of=lead)
        self.joining.append(lead)
        occupied = [i for i, r in enumerate(self.rows) if r is not None]
        self._resize(self._batch_bucket(max(occupied) + 1))

    def _begin(self, lead: _Row, logits: torch.Tensor) -> None:
        """``lead``'s prompt is complete (``logits`` [1, V] its last token's): the request's other
        rows take its slots, and all of them start."""
        lead_slot = next(i for i, r in enumerate(self.rows) if r is lead)  # by identity: rows are dataclasses
        slots = [lead_slot]
        extent = self._extent()
        for slot, row in enumerate(self.rows):
            if row is not None and row.copy_of is lead:
                self.device_rows.move(self.bucket, lead_slot, slot, extent)
                row.prompt_done, row.copy_of = row.prompt_len, None
                slots.append(slot)
        self._start(slots, logits)

    def _answer_offline(self, handle: RequestHandle) -> None:
        from ..requests import batch_length

        request = handle.offline
        lengths = [len(ids) for ids in self.tokenizer.encode_batch(request.prompts)]
        request.max_tokens = min(request.max_tokens, self.config.max_length - max(lengths))
        length = batch_length(max(lengths), request.max_tokens)
        try:
            budget = length * len(lengths) * request.rows_per_prompt
            records, tokens = self.device_rows.answer_offline(request, lengths, length, budget, handle.params.adapter)
        except Exception as error:
            handle.emit(Event("error", message=f"{type(error).__name__}: {error}"))
            return
        self.tokens_total += tokens
        self.metrics.tokens(tokens)
        handle.emit(Event("record", record=records[0]["result"]))

    # --- rows advancing and leaving ---------------------------------------------------------------

    def _advance(self, slot: int, token: int, lp: TokenLogprob | None, now: float) -> None:
        """Row ``slot`` chose ``token``: stream what may be given out, end the row if it is done."""
        row = self.rows[slot]
        handle, stops = row.handle, row.handle.params.stop
        if handle.first_token_at is None:
            handle.first_token_at = now
            self.metrics.first_token(now - handle.submitted)
        elif row.ids:
            self.metrics.inter_token(now - row.last_time)
        row.last_time = now
        row.ids.append(token)
        row.pending.append(lp)
        eos = token == self.eos and not handle.params.ignore_eos
        if not eos:
            row.out.add(token)
        reason = ("eos" if eos else "stop" if row.out.stopped else "length" if len(row.ids) >= row.limit else None)
        if reason is None:
            piece = row.out.take()
            if piece:
                # Ids go out with the text they spell, once no stop string can still claim it.
                self._send(row, piece, len(row.ids) - row.ids_given if row.out.all_given else 0)
            return
        # The finished sequence is the truth (text_ends: EOS, stop strings), as offline.
        sequence = make_sequence(self.tokenizer, row.ids, reason, stops=stops)
        self._send(row, sequence.text[row.out.given :], max(0, len(sequence.token_ids) - row.ids_given))
        for index in row.indices:
            handle.sequences[index] = sequence
            handle.emit(Event("finish", index=index, finish_reason=sequence.finish_reason, sequence=sequence))
        self.rows[slot] = None
        if len(handle.sequences) == handle.params.n:
            completion = sum(len(s.token_ids) for s in handle.sequences.values())
            usage = {"prompt_tokens": len(handle.prompt_ids), "completion_tokens": completion,
                     "total_tokens": len(handle.prompt_ids) + completion}
            handle.emit(Event("done", usage=usage))

    def _send(self, row: _Row, text: str, count: int) -> None:
        ids = row.ids[row.ids_given : row.ids_given + count]
        lps = row.pending[:count]
        del row.pending[:count]
        row.ids_given += count
        if not text and not ids:
            return
        logprobs = lps if row.handle.params.logprobs is not None else None
        for index in row.indices:
            row.handle.emit(Event("delta", index=index, text=text, token_ids=ids, logprobs=logprobs))

    def _drop_cancelled(self) -> None:
        for i, row in enumerate(self.rows):
            if row is not None and row.handle.cancelled.is_set():
                self.rows[i] = None

    def _fail_all(self, message: str) -> None:
        handles = {id(r.handle): r.handle for r in self.rows if r is not None}
        self.rows = [None] * self.config.max_batch
        self.bucket = 0
        for handle in handles.values():
            handle.emit(Event("error", message=message))

    # --- slots and buckets ----------------------------------------------------------------------

    def _extent(self) -> int:
        """Slots written so far by any running row (what a move must copy), rounded up to its
        length bucket so that the copies keep a few shapes."""
        written = max((r.written for r in self.rows if r is not None), default=0)
        return self._length_bucket(written) if written else 0

    def _compact(self) -> None:
        """Keep running rows in the lowest slots, so the batch bucket can shrink as rows leave."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        if not live:
            self.bucket = 0
            return
        target = self._batch_bucket(len(live))
        extent = self._extent()
        while max(live) >= target:
            src, dst = max(live), self.rows.index(None)
            self.device_rows.move(self.bucket, src, dst, extent)
            self.opts.move_row(src, dst)
            self.generator.backend.mark_step()
            self.rows[dst], self.rows[src] = self.rows[src], None
            self.stats["row_moves"] += 1
            live = [i for i, r in enumerate(self.rows) if r is not None]
        self._resize(target)

    def _resize(self, bucket: int) -> None:
        """Run in the cache of ``bucket`` rows from now on; the running rows' live slots move over."""
        if bucket == self.bucket:
            return
        if self.bucket:
            self.device_rows.resize(self.bucket, bucket, self._extent())
            self.stats["bucket_changes"] += 1
        self.bucket = bucket
