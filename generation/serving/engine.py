"""The serving engine: continuous batching over a fixed set of rows, in static shapes. No HTTP.

One thread owns the model (``start``). Requests arrive through a thread-safe queue (``submit``,
``submit_offline``) and join between steps, first come first served; events stream back through
each request's sink (``handles.RequestHandle``). Each step (``step``):

1. **Admit** what fits (``admission.py``): a burst onto an idle engine is prefilled in groups; while
   rows run, a request takes its slots at once and its prompt joins in segments inside their decode
   steps. Other searches (beams, ``best_of > n``, echo with log-probs...) are answered in a batch of
   their own (``answer_offline``).
2. **Choose** every running row's next token, per-row options as tensors (``row_options.py``, read
   by ``search/choose.choose_rows``; structured output as a [b, V/32] bitmask of allowed tokens
   made on the host, ``structured.py``), and **hand out** what each row gives (``output.py``): the [b]
   tokens come to the host once, the step's one sync, where streaming, EOS, stop strings and budgets
   are decided.
3. **Compact**: running rows keep the lowest slots and the smallest batch bucket (``slots.py``).
4. **Decode**: one [b, 1] step in the bucket's cache, each row at its own position, with the next
   segments of joining prompts in it (``DeviceRows.mixed``), over a window that is the length bucket
   of the furthest slot; its logits wait for the next step's choice. With ``--speculate``
   (``EngineConfig.speculation``) it is a verify pass of each row's last token and its own guesses
   whenever some row has guesses (its own earlier text, or a draft model's: ``drafting.py``), and
   the choice then keeps several tokens a row (``speculating.py``).

* **Caches and steps** live in ``device_rows.py``: one KV cache per batch bucket, allocated once,
  and the steps, called with host values only (so a tensor-parallel server can send each call to
  every rank: ``tp_serving.py``).
* **Warm-up** runs every (prefill bucket, length bucket), (batch bucket, window) and (batch bucket,
  window, segment count) once, so after it no load adds a step signature (``backend.signatures``).
* **LoRA adapters** (``bloom_hpu/lora_rows.py``, when the generator serves some): requests
  prefilled together share one adapter; each row's adapter index is written when it joins and
  moves with it (``DeviceRows.place`` / ``move``); an offline answer runs with every row reading
  its request's adapter.
* **Other searches.** Beam search, ``best_of > n``, ``echo`` with log-probs, ``max_tokens`` 0 and
  ``no_repeat_ngram_size`` are answered by the batch runner's path (``answers.answer_batch`` over
  ``Generator.generate``) in a batch of their own, between two steps. Those use the generator's own
  shapes, not the engine's.
"""

from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass

import torch

from bloom_hpu.runtime.transfer import host_to_device

from ..run.logprobs import TokenText
from ..search.choose import RowFlags, choose_rows
from ..search.guesses import Speculation, worth_verifying
from ..request.grammar import GrammarError, RowGrammar, for_tokenizer, mask_words
from .admission import Admission
from .device_rows import DeviceRows
from .handles import EngineError, EngineStopped, QueueFull, RequestHandle, Row
from .heap import freeze_long_lived
from .output import Output, to_host
from .params import Event, SamplingParams
from .row_options import RowOptions
from .slots import Slots
from .speculating import adapt, choose_verified, propose


@dataclass
class EngineConfig:
    max_batch: int = 8
    max_length: int = 128
    bucket_width: int = 32  # length buckets (prompt padding, decode windows); 0: max_length only
    max_queue: int = 256
    max_prefill: int = 4  # prompts prefilled together in one step (when no row is running)
    prefill_chunk: int = 64  # prompt tokens fed per decode step while rows run (in segments)
    burst_wait_ms: float = 8.0  # idle engine: gather arrivals until none came for this long (0: off)
    speculation: Speculation | None = None  # rows verify their own guesses (speculating.py), or None


class EngineMetrics:
    """What the engine reports as it runs; the app backs it with Prometheus. No-ops here."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def tokens(self, count: int) -> None: ...

    def speculated(self, offered: int, accepted: int) -> None:
        """One verify pass: guesses it offered, of them accepted."""


class Engine:
    def __init__(self, generator, config: EngineConfig = EngineConfig(), metrics: EngineMetrics | None = None,
                 device_rows: DeviceRows | None = None):
        self.generator = generator
        self.config = config
        self.metrics = metrics or EngineMetrics()
        self.tokenizer = generator.tokenizer
        self.device = generator.device
        self.pad = self.tokenizer.pad_token_id
        self.lora = getattr(generator, "lora", None)  # ServedAdapters, or None
        self.speculation = config.speculation
        verify_k = config.speculation.shape_k if config.speculation else 0
        drafting = config.speculation is not None and config.speculation.kind == "draft"  # DeviceRows checks the draft
        self.device_rows = device_rows or DeviceRows(generator, config.max_batch, config.max_length,
                                                     config.bucket_width, config.max_prefill, config.prefill_chunk,
                                                     verify_k, drafting)
        vocab = generator.runner.model.config.vocab_size
        if self.speculation is None:
            self.logits = torch.zeros(config.max_batch, vocab, dtype=torch.float32, device=self.device)  # [R, V]
        else:
            # A verify pass's logits at every position [R, K + 1, V]; a decode's (and a prefill's
            # first token's) go to position 0, which ``logits`` views.
            self.verified_logits = torch.zeros(config.max_batch, verify_k + 1, vocab, dtype=torch.float32,
                                               device=self.device)
            self.logits = self.verified_logits[:, 0]
        # The last verify pass, until its tokens are chosen: (the row in each slot, [R, K] guesses on
        # the device, each slot's guess count); None after a plain decode.
        self._verified: tuple[list, torch.Tensor, list[int]] | None = None
        self.opts = RowOptions(config.max_batch, vocab, config.max_length, self.device, self.pad)
        self.vocab = vocab
        # Structured output: every row's allowed tokens of a step, filled on the host ([R, V/32] int32).
        self.masks = torch.full((config.max_batch, mask_words(vocab)), -1, dtype=torch.int32)
        self.ready = threading.Event()
        self.failure: str | None = None  # "the engine stopped: <its error>" once its thread ended on one
        self.warmup_report: dict | None = None
        self.tokens_total = 0
        # What the scheduler did, for tests and the benchmark: most rows at once, rows moved to
        # lower slots, batch-bucket changes, prefill steps and the prompts they held, mixed steps
        # (decodes with a prompt chunk) and the prompts that joined that way.
        self.stats = {"peak_rows": 0, "row_moves": 0, "bucket_changes": 0, "prefills": 0, "prompts_prefilled": 0,
                      "mixed_steps": 0, "prompts_chunked": 0, "joined_after_a_hit": 0,
                      "verify_passes": 0, "verify_mixed_steps": 0, "guesses_offered": 0, "guesses_accepted": 0,
                      "decodes_stepped_aside": 0}
        # Called once a step, after its events are handed out (the app: wait, briefly, until its
        # event loop has sent them). On the CPU before the decode, so that the loop and the decode's
        # threads do not compete for the cores; on a card after the decode is launched, so that the
        # loop sends while the card computes.
        self.flush_events = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        backend = generator.backend
        self.slots = Slots(self.device_rows, self.opts, backend, config.max_batch, self.stats)
        self.admission = Admission(config, self.slots, self.device_rows, self.opts, self.logits,
                                   TokenText(self.tokenizer), backend, self.device, self.stats, self._wake,
                                   self._answer_offline)
        self.output = Output(self.slots, self.tokenizer, self.metrics)

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
        if params.grammar is not None:
            # Compiled here, on the caller's thread (cached per grammar), never in a step.
            try:
                self.grammars.check(params.grammar)
            except GrammarError as error:
                raise EngineError(str(error), error.field) from None
        return self._enqueue(RequestHandle(list(prompt_ids), params, sink))

    @property
    def grammars(self):
        """The grammar library's view of the tokenizer (``structured.Compiler``; made at warm-up)."""
        return for_tokenizer(self.tokenizer, self.vocab)

    def submit_offline(self, request, prompt_ids: list[list[int]], sink=None, adapter: int = 0) -> RequestHandle:
        """A requests.Request answered by the batch runner's path (beams, best_of, echo with
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
        if self.failure is not None:
            raise EngineStopped(self.failure)
        try:
            self.admission.inbox.put_nowait(handle)
        except queue.Full:
            raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting)") from None
        if self.failure is not None:  # it stopped as this one came in: no thread will take it
            self._fail_queued()
        self._wake.set()
        return handle

    @property
    def queue_length(self) -> int:
        return self.admission.queue_length

    @property
    def rows(self) -> list[Row | None]:
        """The row in each slot, or None."""
        return self.slots.rows

    @property
    def running_rows(self) -> int:
        return sum(r is not None for r in self.slots.rows)

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
        try:
            self._serve(warm_up)
        except BaseException as error:  # the warm-up failed, or something no step catches: the engine is gone
            self.failure = f"the engine stopped: {type(error).__name__}: {error}"
            print(f"error: {self.failure}", file=sys.stderr, flush=True)
            self._fail_all(self.failure)
            self._fail_queued()

    def _serve(self, warm_up: bool) -> None:
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

    def _fail_all(self, message: str) -> None:
        for handle in self.slots.clear():
            handle.emit(Event("error", message=message))

    def _fail_queued(self) -> None:
        """Every queued request gets the engine's failure (no thread is left to take them)."""
        waiting = self.admission.waiting
        while True:
            try:
                waiting.append(self.admission.inbox.get_nowait())
            except queue.Empty:
                break
        while waiting:
            try:
                waiting.popleft().emit(Event("error", message=self.failure))
            except IndexError:  # another thread took the last one
                break

    def warm_up(self) -> dict:
        """Run every step shape the engine uses (``DeviceRows.warm_up``)."""
        self.warmup_report = self.device_rows.warm_up()
        self.grammars  # reading the vocabulary (seconds for BLOOM's) is not a first request's wait
        return self.warmup_report

    # --- one scheduler step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> bool:
        """Admit what fits, choose a token for every running row, hand out the results, decode.
        Returns False when there was nothing to do."""
        self.slots.drop_cancelled()
        ran_offline = self.admission.admit()
        if self.slots.idle():
            return ran_offline
        live = self.slots.running()
        if live:
            self._choose(live)
        self.slots.compact()
        overlap = self.generator.backend.asynchronous_steps
        if self.flush_events is not None and not overlap:
            self.flush_events()
        self._decode()
        if self.flush_events is not None and overlap:
            self.flush_events()
        self._prepare_masks()
        return True

    def _choose(self, live: list[int]) -> None:
        """Choose the next token of the running rows ``live`` and hand out what they give."""
        b = self.slots.bucket
        rows = [r if r is not None and r.running else None for r in self.slots.rows[:b]]  # joining rows count as free
        used, steps = self.device_rows.upload([r.prompt_len + len(r.ids) if r else 0 for r in rows],
                                              [len(r.ids) if r else 0 for r in rows])
        params = [self.slots.rows[i].handle.params for i in live]
        flags = RowFlags(params)
        if self.generator.backend.compiles_eager_ops:
            flags.every_processor()
        logits = self.logits[:b]
        masks = self._masks(rows) if flags.grammar else None
        top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        self.stats["peak_rows"] = max(self.stats["peak_rows"], len(live))
        if self._verified is not None:
            handed = self._choose_verified(live, rows, used, steps, flags, masks, top)
        else:
            tokens = choose_rows(logits, self.opts, b, used, steps, flags, self.generator.noise_kernel, masks)  # [b]
            self.opts.record(b, used, tokens, flags.repetition, flags.openai_penalties)
            host = to_host(logits, tokens, top)
            self.generator.backend.mark_step()
            self.output.hand_out(live, host, top)
            handed = len(live)
        self.tokens_total += handed
        self.metrics.tokens(handed)

    def _choose_verified(self, live: list[int], rows: list, used, steps, flags: RowFlags, masks, top) -> int:
        """``_choose`` after a verify pass: every row's tokens at its verified positions, handed out
        one position at a time (a row ends where the plain step would end it, and hands nothing after).
        Returns how many tokens were handed out."""
        b = len(rows)
        verified_rows, guesses, offered = self._verified
        self._verified = None
        # A slot whose row changed since the pass (cancelled, then taken by a new request) offered nothing.
        counts = [offered[i] if i < len(verified_rows) and rows[i] is verified_rows[i] else 0 for i in range(b)]
        tokens, accepted = choose_verified(self.verified_logits[:b], self.opts, b, used, steps, guesses[:b],
                                           host_to_device(torch.tensor(counts), self.device), flags,
                                           self.generator.noise_kernel, masks)  # [b, S], [b]
        self.opts.record_verified(b, used, tokens, accepted + 1, flags.repetition, flags.openai_penalties)
        later = torch.cat([tokens, accepted[:, None]], dim=1).tolist()  # [b, S + 1]: the step's one read
        s = tokens.shape[1]
        if top is not None:  # every position's log-probs, the target's (a second read)
            scored = to_host(self.verified_logits[:b].reshape(b * s, -1), tokens.reshape(-1), top)  # [b*S] rows
        self.generator.backend.mark_step()
        taken = [later[i][-1] for i in range(b)]
        self.stats["guesses_offered"] += sum(counts)
        self.stats["guesses_accepted"] += sum(min(a, c) for a, c in zip(taken, counts))
        self.metrics.speculated(sum(counts), sum(min(a, c) for a, c in zip(taken, counts)))
        adapt(rows, counts, taken)
        handed = 0
        for j in range(len(later[0]) - 1):
            # Rows still running that keep position j: their accepted guesses and the token after.
            at = [i for i in live if self.slots.rows[i] is rows[i] and j <= taken[i]]
            if not at:
                break
            host = scored[j::s] if top is not None else [[t[j]] for t in later]  # row i's position j, by slot
            self.output.hand_out(at, host, top)
            handed += len(at)
        return handed

    def _masks(self, rows: list[Row | None]) -> torch.Tensor:
        """[b, V/32] int32 on the device: each running row's allowed tokens (all, without a grammar)."""
        host = self.masks[: len(rows)]
        host.fill_(-1)
        for slot, row in enumerate(rows):
            if row is not None and row.handle.params.grammar is not None:
                if row.grammar is None:
                    row.grammar = RowGrammar(self.grammars.matcher(row.handle.params.grammar), self.vocab)
                host[slot] = row.grammar.prepare()[0]
        return host_to_device(host, self.device)

    def _prepare_masks(self) -> None:
        """The next masks of the constrained rows, computed on the host after the decode was handed
        to the device: on a card they cost no step time (on the CPU the same work as in ``_masks``)."""
        for row in self.slots.rows:
            if row is not None and row.grammar is not None and row.running:
                row.grammar.prepare()

    def _decode(self) -> None:
        """One [b, 1] decode of every running row, with the next segments of joining prompts in it
        if any; its logits wait for the next step's choice."""
        bucket = self.slots.bucket
        if not bucket:
            return
        rows = self.slots.rows[:bucket]
        # The token chosen last sits at slot prompt_len + generated - 1; free rows write slot 0. A
        # joining row writes a filler at the next slot of its prompt, which its next segment (or,
        # for a copy, its first row's slots) replaces before anything reads it.
        positions = [(r.prompt_len + len(r.ids) - 1 if r.running else r.prompt_done) if r else 0 for r in rows]
        tokens = [r.ids[-1] if r and r.running else self.pad for r in rows]
        segments = self.admission.next_segments()
        if not segments:
            if not any(r is not None and r.running for r in rows):
                return  # only copies waiting for their first row: nothing to decode
            if self.speculation is not None and self._verify(bucket, rows, tokens, positions) is not None:
                return
            out = self.device_rows.decode(bucket, tokens, positions, self.device_rows.length_bucket(max(positions) + 1))
            self.logits[:bucket].copy_(out)
            self.generator.backend.mark_step()
            return
        furthest = max(max(positions) + 1, max(start + len(ids) for _, _, start, ids in segments))
        pieces = [(slot, start, ids, row.handle.params.adapter) for slot, row, start, ids in segments]
        try:
            joined = None  # the segments' logits [G, V]
            if self.speculation is not None and self.device_rows.lora is None:
                joined = self._verify(bucket, rows, tokens, positions, pieces, furthest)
            if joined is None:
                window = self.device_rows.length_bucket(furthest)
                out = self.device_rows.mixed(bucket, tokens, positions, window, pieces)
                self.logits[:bucket].copy_(out[:bucket])
                joined = out[bucket:]
        except Exception as error:  # these requests fail alone; the running rows decode without them
            handles = list({id(row.handle): row.handle for _, row, _, _ in segments}.values())
            self.slots.unseat(handles)
            for handle in handles:
                handle.emit(Event("error", message=f"internal error: {error!r}"))
            self.slots.compact()
            self._decode()
            return
        self.stats["mixed_steps"] += 1
        for s, (_, row, _, ids) in enumerate(segments):
            row.prompt_done += len(ids)
            if row.running:  # this segment ended its prompt: its logits are the first token's
                self.stats["prompts_chunked"] += 1
                self.admission.begin(row, joined[s : s + 1])
        self.generator.backend.mark_step()

    def _verify(self, bucket: int, rows: list, tokens: list[int], positions: list[int], pieces: list = (),
                furthest: int = 0) -> torch.Tensor | None:
        """A verify pass in place of the decode (or of the mixed step carrying prompt segments
        ``pieces``, whose slots reach ``furthest``) when some running row offers guesses
        (``speculating.py``): row i feeds its last token and its guesses from ``positions[i]``.
        Returns the segments' logits [G, V] (G = 0 without any), or None when no row offered a
        guess (their budgets count the wait): decode instead."""
        s = self.speculation.shape_k + 1
        if not worth_verifying(bucket, s, self.device):  # a batch this large decodes: it steps aside
            self.stats["decodes_stepped_aside"] += 1
            return None
        guesses, counts = propose(rows, self.speculation, self.config.max_length, self.device_rows)
        if not any(counts):
            adapt(rows, counts, counts)
            return None
        window = self.device_rows.length_bucket(min(self.config.max_length, max(max(positions) + s, furthest)))
        ids = [[t] + g for t, g in zip(tokens, guesses)]
        if pieces:
            out = self.device_rows.verify_mixed(bucket, ids, positions, window, pieces)  # [b*S + G, V]
            self.stats["verify_mixed_steps"] += 1
            self.verified_logits[:bucket].copy_(out[: bucket * s].view(bucket, s, -1))
            joined = out[bucket * s :]
        else:
            out = self.device_rows.verify(bucket, ids, positions, window)  # [b, S, V]
            self.verified_logits[:bucket].copy_(out)
            joined = out[:0, 0]
        padded = guesses + [[0] * (s - 1)] * (self.config.max_batch - bucket)
        self._verified = (list(rows), host_to_device(torch.tensor(padded), self.device), counts)
        self.stats["verify_passes"] += 1
        self.generator.backend.mark_step()
        return joined

    def _answer_offline(self, handle: RequestHandle) -> None:
        from ..request.parse import batch_length

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
