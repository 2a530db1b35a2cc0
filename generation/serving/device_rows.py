"""The engine's device side: the KV caches, allocated once, and the steps that run on them.

The engine (``engine.py``) decides everything on the host: which requests join, which slot each
row takes, which token each row chose. It then calls one of the methods below with host values
only (ints and lists of ints), never tensors. That is what lets a tensor-parallel server run: rank 0
sends each call to the other ranks (``tp_serving.py``), and every rank makes the same steps on its
own shard, with the collectives inside the steps pairing up.

* ``caches[b]``: one cache of ``max_length`` slots per *batch bucket* b (1, 2, 4, ... max_batch
  rows). Decode runs in the smallest bucket that holds every running row. Separate caches rather
  than views of one: a step's cache must be contiguous (the CPU's one-call step requires it, and a
  captured graph is bound to its tensors), and ``cache[:, :b]`` of a [layers, B, ...] cache is not.
* ``prefill_caches[k]``: up to k prompts (k = 1, 2, 4, ... max_prefill) prefilled together as one
  [k, P] step, P their length bucket, right-padded, filler rows making up k; each prompt's first P
  slots are then copied into its rows of the decode cache (``place``). The running rows' cache is
  never touched by a prefill. The engine uses this when no row is running (a burst onto an idle
  server).
* ``mixed``: while rows run, prompts are fed inside the decode steps, straight into their rows of
  ``caches[b]`` (``StaticBloom.mixed``): up to ``prefill_chunk`` tokens per step in *segments* of a
  fixed length (``chunk_shape``), each segment a piece of one prompt, so several short prompts (or
  several pieces of a long one) join in one step and the running rows never wait for a prefill.
* ``verify`` (``--speculate``): the decode of rows that offer guesses, [b, K + 1] tokens each (the
  last token and K guesses, ``runtime/steps.VerifyStep``) in ``caches[b]``: logits at every
  position. One shape per (batch bucket, window), K fixed by the server's ``verify_k``; with
  prompt segments in it (``verify_mixed``, as ``mixed`` carries them), one per (batch bucket,
  window, segment count). A rejected guess's keys and values stay in a slot the row writes again
  before anything attends it.
* ``draft`` (``--speculate draft``): the draft model's caches in the same slot layout, moved with
  the rows, and its steps (``drafting.DraftRows``, run through ``draft_step``).
* **The prefix cache** (the runner's pool, when it has one: ``StepRunner.prefix``): a
  prefill copies what the pool holds of its prompts (``runtime/prefixed.py``); a joining prompt's
  held blocks are copied into its row before its first segment (``copy_prefix``), and a row's
  blocks are stored once its prompt is in place and when it ends (``store_prefix``). The pool's
  index is updated inside these calls, which every rank makes in the same order, so the ranks of
  a tensor-parallel server take the same decisions without exchanging any.
"""

from __future__ import annotations

import contextlib
import time

import torch

from bloom_hpu.runtime.backends import HPU_MAX_GRAPHS
from bloom_hpu.runtime.prefixed import cacheable, rest_buckets
from bloom_hpu.runtime.transfer import host_to_device

from ..run.batch import round_up
from .drafting import DraftRows


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return sizes + [max_batch]


def chunk_shape(prefill_chunk: int) -> tuple[int, list[int]]:
    """The prompt tokens a mixed step carries: (segment length, segment counts). Segments of
    max(8, prefill_chunk / 4) tokens (a chunk under 16 is one segment of its own length), up to
    prefill_chunk tokens in all; the number of segments is padded to 1, 2, 4 (or the most that
    fit): at most HPU_MAX_GRAPHS counts, as one mixed step module (per cache and window) serves
    every count and a Gaudi keeps that many graphs per module."""
    if prefill_chunk < 2 * MIN_SEGMENT:
        return prefill_chunk, [1]
    length = max(MIN_SEGMENT, -(-prefill_chunk // MAX_SEGMENTS))
    return length, batch_buckets(prefill_chunk // length)[-HPU_MAX_GRAPHS:]


MIN_SEGMENT = 8  # a shorter piece of a prompt is padded to 8 tokens: more shapes would save little
MAX_SEGMENTS = 4  # per step: each segment reads its row's keys and values once per layer


def prefix_namespace(adapter: int) -> str:
    """Each LoRA adapter computes other keys and values for the same tokens: blocks of its own."""
    return f"lora-{adapter}" if adapter else ""


def length_buckets(max_length: int, width: int) -> list[int]:
    if not width:
        return [max_length]
    return sorted({min(round_up(n, width), max_length) for n in range(1, max_length + 1)})


class DeviceRows:
    def __init__(self, generator, max_batch: int, max_length: int, bucket_width: int, max_prefill: int,
                 prefill_chunk: int = 32, verify_k: int = 0, drafting: bool = False):
        self.generator = generator
        self.runner = generator.runner
        self.device = generator.device
        self.pad = generator.tokenizer.pad_token_id
        self.lora = getattr(generator, "lora", None)  # served LoRA adapters (bloom_hpu/lora_rows.py), or None
        self.max_length = max_length
        self.batch_sizes = batch_buckets(max_batch)
        self.prefill_sizes = batch_buckets(min(max_prefill, max_batch))
        self.lengths = length_buckets(max_length, bucket_width)
        self.segment_length, self.segment_counts = chunk_shape(min(prefill_chunk, max_length))
        self.verify_k = verify_k  # guesses a verify pass carries per row (0: the server does not speculate)
        if drafting and (getattr(generator, "draft", None) is None or not verify_k):
            raise ValueError("speculation with a draft model needs the generator loaded with its draft model "
                             "(Generator.from_pretrained(..., speculate='draft', draft_model=DIR)) and verify_k > 0")
        self.drafts = drafting
        model = self.runner.model
        if self.lora is not None and max_batch + self.chunk_tokens > self.lora.rows.capacity:
            raise ValueError(f"--max_batch plus --prefill_chunk exceeds the {self.lora.rows.capacity} rows "
                             "LoRA adapters are stacked for")
        self._check_memory(model)
        # Our own caches, not the runner's pool: the offline path's generate calls use that pool
        # and must not overwrite the running rows.
        # In the backend's layout: per layer on a Gaudi, where graphs cannot write into views.
        per_layer = self.runner.backend.per_layer_cache
        self.caches = {b: model.allocate_cache(b, max_length, per_layer) for b in self.batch_sizes}
        self.prefill_caches = {k: model.allocate_cache(k, max_length, per_layer) for k in self.prefill_sizes}
        self.draft: DraftRows | None = None  # the draft model's caches and steps (--speculate draft)
        if drafting:
            self.draft = DraftRows(generator.draft, self.batch_sizes, max_length, self.lengths, self.segment_length,
                                   self.segment_counts, self.pad, verify_k)
        self.last_cached: list[int] = []  # prompt tokens of each prompt of the last prefill the pool served

    @property
    def pool(self):
        """The runner's prefix cache (None: none, or paused)."""
        return self.runner.prefix

    def _check_memory(self, model) -> None:
        """Refuse, before allocating, caches that cannot fit (every bucket's, allocated at once)."""
        from ..request.validate import check_memory

        rows = sum(self.batch_sizes) + sum(self.prefill_sizes)
        backend = self.runner.backend
        graphs = 0
        if backend.use_graphs and backend.graphs_every_shape:
            # Each captured decode graph keeps its [b, V] logits (and, on HPU, each prefill graph
            # its own): one per (batch bucket, window) and (prefill bucket, length bucket).
            outputs = sum(self.batch_sizes) * len(self.lengths)
            outputs += sum(b + s for b in self.batch_sizes for s in self.segment_counts) * len(self.lengths)  # mixed
            if self.verify_k:
                outputs += sum(self.batch_sizes) * (self.verify_k + 1) * len(self.lengths)  # verify: [b, K + 1, V]
                if self.lora is None:  # verify_mixed: [b * (K + 1) + G, V]
                    outputs += sum(b * (self.verify_k + 1) + g for b in self.batch_sizes
                                   for g in self.segment_counts) * len(self.lengths)
            if backend.per_layer_cache:
                outputs += sum(self.prefill_sizes) * len(self.lengths)
            if self.drafts:  # the draft's decode and mixed steps, as the target's
                outputs += sum(self.batch_sizes) * len(self.lengths)
                outputs += sum(b + s for b in self.batch_sizes for s in self.segment_counts) * len(self.lengths)
            graphs = outputs * model.config.vocab_size * 4
        if self.drafts:  # its caches, one per batch bucket
            graphs += self.generator.draft.call_bytes(sum(self.batch_sizes), self.max_length, self.max_length)
        check_memory(model.config, self.generator.dtype, self.device, rows, self.max_length, self.max_length,
                     model.parallel, what="--max_batch, --max_prefill, --max_length or --bucket_width", extra=graphs)

    def length_bucket(self, needed: int) -> int:
        return next(n for n in self.lengths if n >= needed)

    @property
    def chunk_tokens(self) -> int:
        """The most prompt tokens one mixed step carries."""
        return self.segment_length * self.segment_counts[-1]

    # --- steps ----------------------------------------------------------------------------------

    @torch.no_grad()
    def warm_up(self) -> dict:
        """Run every step shape the engine uses: a prefill per (prefill bucket, length bucket), a
        decode per (batch bucket, window), a mixed step per (batch bucket, window, segment count)
        and, when speculating, a verify pass per (batch bucket, window).
        Returns what it ran and how long it took."""
        start = time.perf_counter()
        # The prefills as such: the pool would find the filler prompts' blocks and run extends
        # instead (those are warmed up on their own), and it must not keep them.
        with self.runner.prefix_paused():
            # Largest first: graphs captured into one memory pool can then reuse the larger ones' scratch.
            for k in reversed(self.prefill_sizes):
                for p in reversed(self.lengths):
                    self.prefill([[self.pad] * p] * k)

        for b in reversed(self.batch_sizes):
            for window in reversed(self.lengths):
                self.decode(b, [self.pad] * b, [0] * b, window)
                for count in reversed(self.segment_counts):  # pad tokens into row 0: overwritten before use
                    self.mixed(b, [self.pad] * b, [0] * b, window, [(0, 0, [self.pad] * self.segment_length, 0)] * count)
                if self.verify_k:
                    rows = [[self.pad] * (self.verify_k + 1)] * b
                    self.verify(b, rows, [0] * b, window)
                    segment = (0, 0, [self.pad] * self.segment_length, 0)
                    for count in reversed(self.segment_counts if self.lora is None else []):
                        self.verify_mixed(b, rows, [0] * b, window, [segment] * count)
        drafted = self.draft.warm_up() if self.draft is not None else 0
        if self.pool is not None:
            self._warm_up_extends()
        if self.runner.backend.compiles_eager_ops:
            self._warm_up_row_copies()
        self.generator.backend.synchronize()
        return {"draft": drafted,
                "prefill": len(self.prefill_sizes) * len(self.lengths),
                "decode": len(self.batch_sizes) * len(self.lengths),
                "mixed": len(self.batch_sizes) * len(self.lengths) * len(self.segment_counts),
                "verify": (len(self.batch_sizes) * len(self.lengths) * (1 + len(self.segment_counts))
                           if self.verify_k else 0),
                "seconds": time.perf_counter() - start}

    def prefill_size(self, prompts: int) -> int:
        """The prefill bucket k that prefills ``prompts`` prompts together (filler rows make up the rest)."""
        return next(k for k in self.prefill_sizes if k >= prompts)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], adapter: int = 0) -> torch.Tensor:
        """Prefill the prompts (at most ``max_prefill``) into ``prefill_caches[k]``, k =
        ``prefill_size(len(prompts))``, right-padded to the length bucket of the longest, all with
        LoRA ``adapter`` (0: the base model). Rows past the prompts are fillers (one pad token: the
        same shape, and a row of the prefill cache that nothing reads). Returns the last-token logits
        [k, V], row i prompt i's."""
        k, p = self.prefill_size(len(prompts)), self.length_bucket(max(map(len, prompts)))
        requests = len(prompts)
        prompts = prompts + [[self.pad]] * (k - requests)
        padded, lengths = self.upload([ids + [self.pad] * (p - len(ids)) for ids in prompts],
                                      [len(ids) for ids in prompts])
        with self._adapter_only(adapter):
            if self.pool is not None:
                logits = self.runner.prefill_shared(padded, lengths, self.prefill_caches[k], 1, prompt_ids=prompts,
                                                    requests=requests)
                self.last_cached = list(self.pool.stats.per_call)
            else:
                logits = self.runner.prefill(padded, lengths, self.prefill_caches[k])
        self.generator.backend.mark_step()  # the adapters put back, if any, as a unit of its own
        return logits

    # --- the prefix cache -----------------------------------------------------------------------

    def holds_prefix(self, ids: list[int], adapter: int = 0) -> bool:
        """Whether the pool holds a whole block of prompt ``ids`` (host only: no copy, no count)."""
        return self.pool is not None and self.pool.peek(ids, prefix_namespace(adapter),
                                                        cacheable(len(ids), self.pool.block)) > 0

    @torch.no_grad()
    def copy_prefix(self, bucket: int, slot: int, ids: list[int], adapter: int = 0) -> int:
        """Copy the blocks the pool holds of prompt ``ids`` into row ``slot`` of ``caches[bucket]``
        (a prompt about to join in segments): how many of its tokens are now in place (0 without a
        pool). At least its last token is left to compute."""
        if self.pool is None:
            return 0
        blocks = self.pool.match(ids, prefix_namespace(adapter), cacheable(len(ids), self.pool.block))
        self.pool.copy_into(self.caches[bucket], [(slot, i, j) for i, j in enumerate(blocks)],
                            pad_to=self.max_length // self.pool.block)
        self.generator.backend.mark_step()
        return len(blocks) * self.pool.block

    @torch.no_grad()
    def store_prefix(self, bucket: int, slot: int, ids: list[int], upto: int, adapter: int = 0) -> None:
        """Keep the whole blocks of ``ids[:upto]`` that row ``slot`` of ``caches[bucket]`` holds and
        the pool lacks (a prompt in place, or a finished row's prompt and reply)."""
        if self.pool is None:
            return
        self.pool.store(self.caches[bucket], slot, ids, upto, prefix_namespace(adapter),
                        pad_to=self.max_length // self.pool.block)
        self.generator.backend.mark_step()

    def _warm_up_extends(self) -> None:
        """The prefix cache's steps: an extend per (prefill bucket, rest bucket), and the one-row
        prefill and extends of a group's shared prefixes (``runtime/prefixed.py``)."""
        for k in reversed(self.prefill_sizes):
            for rest in reversed(rest_buckets(self.lengths[-1])):
                ids, starts, lengths = self.upload([[self.pad] * rest] * k, [0] * k, [rest] * k)
                self.runner.extend(ids, starts, lengths, self.prefill_caches[k])
        for p in reversed(self.lengths):
            one = self.runner.cache(1, p)
            self.runner.prefill(*self.upload([[self.pad] * p], [p]), one)
            for rest in reversed(rest_buckets(p)):
                ids, starts, lengths = self.upload([[self.pad] * rest], [0], [rest])
                self.runner.extend(ids, starts, lengths, one)

    @torch.no_grad()
    def decode(self, bucket: int, tokens: list[int], positions: list[int], window: int) -> torch.Tensor:
        """One [b, 1] decode in ``caches[bucket]``: row i takes ``tokens[i]`` at ``positions[i]``,
        attending over the first ``window`` slots. Returns logits [b, V]."""
        tokens, positions = self.upload(tokens, positions)
        return self.runner.decode(tokens[:, None], positions, self.caches[bucket], window)

    @torch.no_grad()
    def verify(self, bucket: int, ids: list[list[int]], starts: list[int], window: int) -> torch.Tensor:
        """A verify pass in ``caches[bucket]``: row i feeds ``ids[i]`` (``verify_k + 1`` tokens: its
        last one and its guesses, padded) to slots ``starts[i]``.., each attending the row's slots up
        to its own, below ``window``. Returns logits [b, verify_k + 1, V]."""
        ids, starts = self.upload(ids, starts)
        return self.runner.verify(ids, starts, self.caches[bucket], window)

    @torch.no_grad()
    def verify_mixed(self, bucket: int, ids: list[list[int]], starts: list[int], window: int,
                     segments: list[tuple[int, int, list[int], int]]) -> torch.Tensor:
        """``verify`` with prompt ``segments`` in it, as ``mixed`` takes them (not with LoRA
        adapters: their rows are indexed by token, and a verify row has several). Returns logits
        [b * (verify_k + 1) + len(segments), V]: every position of the rows, then each segment's
        last token's."""
        count = next(n for n in self.segment_counts if n >= len(segments))
        padded = segments + segments[-1:] * (count - len(segments))
        c = self.segment_length
        ids, starts, chunk, rows, chunk_starts, lengths = self.upload(
            ids, starts, [piece + [self.pad] * (c - len(piece)) for _, _, piece, _ in padded],
            [row for row, _, _, _ in padded], [start for _, start, _, _ in padded], [len(p) for _, _, p, _ in padded])
        logits = self.runner.verify_mixed(ids, starts, chunk, rows, chunk_starts, lengths, self.caches[bucket], window)
        return logits[: bucket * (self.verify_k + 1) + len(segments)]

    @torch.no_grad()
    def mixed(self, bucket: int, tokens: list[int], positions: list[int], window: int,
              segments: list[tuple[int, int, list[int], int]]) -> torch.Tensor:
        """A decode in ``caches[bucket]`` (as ``decode``) that also feeds prompt ``segments``, each
        (row, start, ids, adapter): ``ids`` (at most ``segment_length``) go to slots ``start``.. of
        row ``row``, with LoRA ``adapter``. Padded to a segment count by repeating the last segment.
        Returns logits [b + len(segments), V]: the rows', then each segment's last token's."""
        count = next(n for n in self.segment_counts if n >= len(segments))
        padded = segments + segments[-1:] * (count - len(segments))
        c = self.segment_length
        if self.lora is not None:
            # A joining row decodes with its adapter from now on; segment s's tokens are rows
            # b + s*c .. of the step.
            rows, adapters = [], []
            for s, (row, _, _, adapter) in enumerate(padded):
                rows += [row] + list(range(bucket + s * c, bucket + (s + 1) * c))
                adapters += [adapter] * (1 + c)
            self.lora.rows.set_each(rows, adapters)
            self.generator.backend.mark_step()
        # Each its own tensor, no view at an offset (steps.step_input: graphs are cached on that).
        tokens, positions, ids, rows, starts, lengths = self.upload(
            tokens, positions, [ids + [self.pad] * (c - len(ids)) for _, _, ids, _ in padded],
            [row for row, _, _, _ in padded], [start for _, start, _, _ in padded], [len(ids) for _, _, ids, _ in padded])
        logits = self.runner.mixed(tokens[:, None], positions, ids, rows, starts, lengths, self.caches[bucket], window)
        return logits[: bucket + len(segments)]

    @torch.no_grad()
    def draft_step(self, bucket: int, tokens: list[int], positions: list[int], segments: list, first: list[int],
                   guessing: list[bool], used: list[int], idle: list[int], most: int) -> list[list[int]]:
        """The draft's work of one step in its cache of ``bucket`` rows (``drafting.DraftPlan``'s
        fields): each row's ``most`` greedy guesses, on the host."""
        guesses = self.draft.step(bucket, tokens, positions, segments, first, guessing, used, idle, most)
        self.generator.backend.mark_step()
        return guesses

    def _warm_up_row_copies(self) -> None:
        """Every shape of row copy (prefill bucket into batch bucket, within and between batch
        buckets), for a runtime that compiles eager ops (copies of whole rows: see
        ``KVCache.copy_rows``). Rows of pad tokens: nothing real is overwritten before serving."""
        extent = self.lengths[0]
        for b in self.batch_sizes:
            for k in self.prefill_sizes:
                self.place(k, 0, b, [0], extent)
            self.move(b, 0, 0, extent)
            for other in self.batch_sizes:
                if other != b:
                    self.resize(b, other, extent)

    # --- moving rows between caches -------------------------------------------------------------

    def place(self, k: int, row: int, bucket: int, slots: list[int], extent: int, adapter: int = 0) -> None:
        """Copy prompt ``row`` of the last k-prompt prefill into ``slots`` of ``caches[bucket]``:
        its first ``extent`` slots (its length bucket: a few copy shapes, which a Gaudi compiles
        once each; slots past the prompt stay masked until the row writes them). The slots decode
        with LoRA ``adapter`` from now on."""
        for slot in slots:  # one row at a time: the same ops for any number of slots
            if self.lora is not None:
                self.lora.rows.set(slot, adapter)
                self.generator.backend.mark_step()  # (an index write, or none: a unit of its own)
            self.caches[bucket].copy_rows(self.prefill_caches[k], [row], [slot], extent)
            self.generator.backend.mark_step()

    def move(self, bucket: int, src: int, dst: int, extent: int) -> None:
        """Row ``dst`` of ``caches[bucket]`` takes the first ``extent`` slots of row ``src``."""
        cache = self.caches[bucket]
        cache.copy_rows(cache, [src], [dst], extent)
        if self.draft is not None:  # the draft's row moves with it
            self.draft.move(bucket, src, dst, extent)
        self.generator.backend.mark_step()
        if self.lora is not None:
            self.lora.rows.move(src, dst)
            self.generator.backend.mark_step()

    def resize(self, old: int, new: int, extent: int) -> None:
        """The running rows move from ``caches[old]`` to ``caches[new]`` (their first ``extent`` slots)."""
        rows = list(range(min(old, new)))
        self.caches[new].copy_rows(self.caches[old], rows, rows, extent)
        if self.draft is not None:
            self.draft.resize(old, new, extent)
        self.generator.backend.mark_step()

    # --- the batch runner's path ----------------------------------------------------------------

    def answer_offline(self, request, lengths: list[int], length: int, budget: int,
                       adapter: int = 0) -> tuple[list[dict], int]:
        """Beams, best_of, echo with log-probs...: one request through ``Generator.generate``
        (answers.answer_batch), in the generator's own shapes, every row with LoRA ``adapter``,
        without speculation (a generator loaded with its draft model has it as its default; the
        engine's own passes speculate, these do not: beams could not)."""
        from ..run.request_batch import RequestBatch, answer_batch

        speculation, self.generator.speculation = self.generator.speculation, None
        try:
            with self._adapter_only(adapter):
                return answer_batch(self.generator, RequestBatch([request], [lengths], length, budget=budget))
        finally:
            self.generator.speculation = speculation

    @contextlib.contextmanager
    def _adapter_only(self, adapter: int):
        """Within it, every row of a step reads ``adapter`` (a prefill, an offline answer), and the
        prefix cache keeps that adapter's blocks; the running rows' adapters are put back after it."""
        with self.runner.prefix_namespace_of(prefix_namespace(adapter)):
            with self.lora.rows.only(adapter) if self.lora is not None else contextlib.nullcontext():
                yield

    def idle(self) -> None:
        """The engine has nothing to do now (under tensor parallelism rank 0 sends a heartbeat)."""

    def close(self) -> None:
        """The server is stopping (other ranks stop following under tensor parallelism)."""

    def upload(self, *columns) -> list[torch.Tensor]:
        """Host ints -> device long tensors, without a host sync (``runtime/transfer.py``)."""
        return [host_to_device(torch.tensor(c, dtype=torch.long), self.device) for c in columns]
