"""A request file or an evaluation over D model replicas (``--data_parallel D``): the work is split
across replicas, never repeated, and the output is the same as one process's.

Request files (``run_requests_parallel``):

- every rank reads the same input, and rank 0 alone reads the results file (after folding what a
  killed run left in part files, ``parts.py``) and sends every rank the lines still to answer;
- every rank plans the same batches as one process would (``plan_batches``), so each batch is
  exactly one process's batch: the same rows padded together, the same answers; the replicas take
  them from one queue, costliest first, each the next one as soon as it is free (``WorkQueue``):
  batches of mixed length take times no cost model predicts well, and a queue balances by the
  times themselves (a fixed deal, ``deal``, is the fallback where the launch has no store);
- each replica's rank 0 appends its records to its own part file, a batch at a time, flushed and
  fsynced (a kill loses at most the batches in flight); rank 0 shows one bar for the whole job,
  counting the lines in every part;
- at the end rank 0 folds the parts into the results file and rewrites it, atomically, in the order
  one process writes (its batches' order), so the file equals one process's but for the timings.
  A job killed at any moment and run again, with any D, answers only what no part and no results
  line holds.

Evaluation (``evaluate_parallel``): the replicas take the passages' chunks from a queue the same way, each
scores its chunks, rank 0 gathers the per-passage numbers and sums them in one process's order.
Its bar counts the passages of every replica: each replica's leader adds what it scored to one
counter in the launch's key-value store (``SharedCount``).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import time
import uuid
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from bloom_hpu.data_parallel import Replicas
from bloom_hpu.runtime.launch import collective_timeout
from bloom_hpu.tp import ParallelError
from ..request.parse import request_key
from ..request.validate import check_request
from ..run.batch import InputError
from ..run.progress import Progress, log
from ..search.speculation import SpeculationStats
from . import evaluate as ev
from .files import disk_error, is_regular_or_new, lock_results
from .grouping import plan_batches
from .parts import fold_parts, part_path, rewrite_in_order
from .runner import DEFAULT_BUDGET, JobSummary, answer_or_split, answered_keys, error_text, fsync, job_paths, \
    read_requests, repair_results

POLL_SECONDS = 0.5  # how often rank 0 looks at the other replicas' parts while it waits for them


# --- dealing work to replicas ---------------------------------------------------------------------


def deal(costs: list[float], replicas: int) -> list[list[int]]:
    """Indexes of the work items each replica takes: the costliest item first, each to the replica
    with the least cost so far (ties: the lowest replica). Deterministic, so every rank deals alike;
    each replica keeps its items in their planned order."""
    load = [0.0] * replicas
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(replicas), key=lambda g: (load[g], g))
        shares[g].append(i)
        load[g] += costs[i]
    return [sorted(share) for share in shares]


def deal_in_turn(count: int, replicas: int) -> list[list[int]]:
    """Item i to replica i mod D: the plain split ``deal`` is measured against (bench/)."""
    return [list(range(g, count, replicas)) for g in range(replicas)]


def batch_cost(batch) -> float:
    """Tokens a batch's static shape holds (rows x static length): what the budget bounds, and what
    a step's time grows with."""
    rows = sum(len(r.prompts) * r.rows_per_prompt for r in batch.requests)
    return float(rows * batch.length)


def launch_store(environ=None):
    """A client of the key-value store the launcher's rendezvous serves at MASTER_ADDR:MASTER_PORT
    (torchrun's and deepspeed's TCPStore), or None where the launch has none or it cannot be reached."""
    environ = os.environ if environ is None else environ
    try:
        store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))
    except (KeyError, ValueError, RuntimeError):
        return None
    store.set_timeout(datetime.timedelta(seconds=collective_timeout()))  # a follower waits on its leader's post
    return store


class WorkQueue:
    """This replica's work items (a request file's batches, an evaluation's chunks), taken one at a
    time from a queue every replica shares: the items in ``deal``'s order (costliest first) and one
    counter, ``key``, in the launch's store. A replica's leader takes the next index when it is free
    (``store.add``) and, where the replica has several ranks, posts it under its replica and turn
    for its followers (``store.get`` waits for it), so the ranks of a replica run the same items in
    lockstep. Without a store (``store=None``) the replica runs its share of a fixed ``deal``."""

    def __init__(self, items: list, costs: list[float], replicas: Replicas, store=None, key: str | None = None):
        self.items, self.costs, self.replicas = items, costs, replicas
        self.order = sorted(range(len(items)), key=lambda i: (-costs[i], i))
        self.store, self.key = store, key

    @classmethod
    def shared(cls, items: list, costs: list[float], replicas: Replicas, environ=None) -> "WorkQueue":
        """The queue of a launch: every rank must call it (an all-gather over ``coordination``);
        where any rank cannot reach the launch's store, every replica falls back to the deal."""
        if replicas.count == 1:
            return cls(items, costs, replicas)
        store = launch_store(environ)
        said = [None] * replicas.count * replicas.ranks_per_replica
        dist.all_gather_object(said, (store is not None, f"bloom-work-{uuid.uuid4().hex}"),
                               group=replicas.coordination)
        if not all(reached for reached, _ in said):
            return cls(items, costs, replicas)
        return cls(items, costs, replicas, store, said[0][1])  # rank 0's key: a count no earlier job touched

    def fixed_share(self) -> list:
        """This replica's items of the fixed ``deal`` (what it runs where there is no store)."""
        return [self.items[i] for i in deal(self.costs, self.replicas.count)[self.replicas.index]]

    def __iter__(self):
        replicas = self.replicas
        if self.store is None:
            yield from self.fixed_share()
            return
        for turn in itertools.count():
            posted = f"{self.key}/replica{replicas.index}/turn{turn}"
            if replicas.leads:
                taken = self.store.add(self.key, 1) - 1
                if replicas.ranks_per_replica > 1:
                    self.store.set(posted, str(taken))
            else:
                taken = int(self.store.get(posted))
            if taken >= len(self.order):
                return
            yield self.items[self.order[taken]]


# --- request files ------------------------------------------------------------------------------


def run_requests_parallel(generator, requests_path, results_path, replicas: Replicas, *, errors_path=None,
                          budget: int = DEFAULT_BUDGET, progress: bool = True) -> JobSummary | None:
    """Answer every request of ``requests_path`` not yet answered, split over ``replicas``. Every
    rank calls it; rank 0 returns the whole job's summary, the other ranks None."""
    start = time.perf_counter()
    results_path, errors_path = job_paths(requests_path, results_path, errors_path, budget)
    if not is_regular_or_new(results_path):
        raise InputError(f"--data_parallel writes --results {results_path} in parts and joins them: it must be a "
                         "regular file, not a pipe or a device")
    requests, bad_lines = read_requests(requests_path)
    if replicas.count > len(requests):
        raise ParallelError(f"--data_parallel {replicas.count} is more than the {len(requests)} request(s) of "
                            f"{requests_path}: some replicas would have nothing to do; use at most {len(requests)}")
    first = replicas.world_rank == 0

    # Rank 0 alone reads and folds the results; everyone gets the same answer from it.
    out, pending_lines, message = None, None, None
    if first:
        try:
            out = lock_results(results_path)
            repair_results(results_path)
            fold_parts(results_path, out)
            done = answered_keys(results_path)
            pending_lines = []
            for r in requests:
                if done[r.key] > 0:
                    done[r.key] -= 1
                else:
                    pending_lines.append(r.line)
        except (InputError, OSError) as error:
            message = str(error)
    shared = [(pending_lines, message)]
    dist.broadcast_object_list(shared, src=0, group=replicas.coordination)
    pending_lines, message = shared[0]
    if message is not None:  # every rank stops alike; rank 0 says why
        if out is not None:
            out.close()
        raise ParallelError(message)
    try:
        return _run(generator, requests, bad_lines, set(pending_lines), requests_path, results_path, errors_path,
                    out, replicas, budget, progress and first, start)
    finally:
        if out is not None:
            out.close()


def _run(generator, requests, bad_lines, pending_lines, requests_path, results_path, errors_path, out, replicas,
         budget, progress, start) -> JobSummary | None:
    first = replicas.world_rank == 0
    errors = open(errors_path, "w", encoding="utf-8") if first else None

    def report(line: int, message: str, text: str) -> None:
        log(f"{requests_path}: line {line}: {message}")
        errors.write(json.dumps({"line": line, "error": message, "text": text}, ensure_ascii=False) + "\n")
        errors.flush()

    try:
        if first:
            for line, message, text in bad_lines:
                report(line, message, text)
        skipped = len(requests) - len(pending_lines)
        if skipped and first:
            log(f"resuming: {skipped} of {len(requests)} requests already answered in {results_path}")
        lengths, planned, fitting = {}, [], []
        for r in requests:
            lengths[r.line] = [len(ids) for ids in generator.tokenizer.encode_batch(r.prompts)]
            if r.line not in pending_lines:
                planned.append(r)  # answered by an earlier run: it fit then
                continue
            try:
                check_request(generator, r, lengths[r.line])
            except Exception as error:  # noqa: BLE001 - one line's problem, whatever it is, is that line's
                if first:
                    report(r.line, error_text(error), json.dumps(r.raw, ensure_ascii=False))
                continue
            planned.append(r)
            fitting.append(r)
        batches = plan_batches(fitting, lengths, budget)
        mine = WorkQueue.shared(batches, [batch_cost(b) for b in batches], replicas)
        speculated = SpeculationStats() if getattr(generator, "speculation", None) is not None else None
        answered, tokens, cached, failures = _answer(generator, mine, results_path, replicas, progress, len(fitting),
                                                     speculated)

        # Every rank waits here for the last replica; rank 0 gets every replica's counts and failures.
        gathered = [None] * replicas.count * replicas.ranks_per_replica
        dist.all_gather_object(gathered, (answered, tokens, cached, failures, speculated) if replicas.leads else None,
                               group=replicas.coordination)
        if not first:
            return None
        counts = [g for g in gathered if g is not None]
        # One process's order: the plan over every request that fits, answered now or before.
        order = {r.line: n for n, r in enumerate(r for b in plan_batches(planned, lengths, budget) for r in b.requests)}
        failed = sorted((f for c in counts for f in c[3]), key=lambda f: order.get(f[0], 0))
        for line, message, text in failed:
            report(line, message, text)
        fold_parts(results_path, out)
        rewrite_in_order(results_path, _positions(planned, order))
        check_failed = len(pending_lines) - len(fitting)
        if speculated is not None:  # every replica's speculation, over the job
            speculated = SpeculationStats()
            for c in counts:
                speculated.add(c[4])
        return JobSummary(len(requests), skipped, sum(c[0] for c in counts),
                          len(bad_lines) + check_failed + len(failed), sum(c[1] for c in counts),
                          time.perf_counter() - start, sum(c[2] for c in counts), speculation=speculated)
    finally:
        if errors is not None:
            errors.close()


def _answer(generator, batches, results_path, replicas, progress, total,
            speculated: SpeculationStats | None) -> tuple[int, int, int, list]:
    """Answer this replica's batches; its leader appends the records to its part file, and
    ``speculated`` gathers what speculation did."""
    part = open(part_path(results_path, replicas.index), "ab") if replicas.leads else None
    watch = _PartCounter(results_path, replicas.count) if progress else None
    answered, tokens, cached, failures = 0, 0, 0, []
    try:
        with Progress(total, "requests", "requests", enabled=progress) as bar:
            for batch in batches:
                for records, batch_tokens, failed in answer_or_split(generator, batch, speculated):
                    failures += [(r.line, message, json.dumps(r.raw, ensure_ascii=False)) for r, message in failed]
                    if records and part is not None:
                        data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
                        try:
                            part.write(data)
                            part.flush()
                            fsync(part)
                        except OSError as error:
                            raise disk_error(part.name, error) from None
                    answered += len(records)
                    tokens += batch_tokens
                    cached += sum(rec["result"]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                                  for rec in records)
                if watch:
                    bar.update(watch.lines() - bar.n)
            if watch:  # this replica is done: follow the others until every rank arrives
                waiting = dist.barrier(group=replicas.coordination, async_op=True)
                while not waiting.is_completed():
                    time.sleep(POLL_SECONDS)
                    bar.update(watch.lines() - bar.n)
                waiting.wait()
                bar.update(watch.lines() - bar.n)
            elif replicas.count > 1:
                dist.barrier(group=replicas.coordination)
    finally:
        if part is not None:
            part.close()
    return answered, tokens, cached, failures


class _PartCounter:
    """Lines written so far to the parts of this run, read incrementally (for the progress bar)."""

    def __init__(self, results_path: Path, count: int):
        self.paths = [part_path(results_path, g) for g in range(count)]
        self.seen = [0] * count
        self.newlines = [0] * count

    def lines(self) -> int:
        for g, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.seen[g])
                    data = f.read()
            except FileNotFoundError:
                continue
            self.seen[g] += len(data)
            self.newlines[g] += data.count(b"\n")
        return sum(self.newlines)


def _positions(planned, order):
    """record -> its place in one process's results file (None for a request not in the input)."""
    slots: dict[str, list[int]] = {}
    for r in sorted(planned, key=lambda r: order[r.line]):
        slots.setdefault(r.key, []).append(order[r.line])
    taken = Counter()

    def position(record: dict) -> int | None:
        key = request_key(record["request"])
        places = slots.get(key, [])
        if taken[key] >= len(places):
            return None
        taken[key] += 1
        return places[taken[key] - 1]

    return position


# --- evaluation ---------------------------------------------------------------------------------


class SharedCount:
    """A count every rank of the launch can add to and read: one key in the key-value store the
    launcher's rendezvous serves (``launch_store``). Not a collective: replicas finish their chunks at their own pace, and a collective would
    make each wait for the others. ``key``: the same on every rank, new for each count."""

    def __init__(self, store, key: str):
        self.store, self.key = store, key

    def add(self, n: int) -> int:
        return self.store.add(self.key, n)

    def value(self) -> int:
        return self.store.add(self.key, 0)


def evaluate_parallel(generator, texts: list[str], replicas: Replicas, budget: int = 8192,
                      progress: bool = False) -> ev.EvalResult | None:
    """``evaluate`` split over the replicas; rank 0 returns the result, the other ranks None."""
    if replicas.count > len(texts):
        raise ParallelError(f"--data_parallel {replicas.count} is more than the {len(texts)} passages: "
                            f"use at most {len(texts)}")
    rows, targets = ev.encode_passages(generator, texts)
    chunks = ev.plan_chunks(rows, budget)
    mine = WorkQueue.shared(chunks, [len(c) * ev.static_length(max(len(rows[i]) for i in c)) for c in chunks],
                            replicas)
    scored = {}
    first = replicas.world_rank == 0
    # The passages scored, counted beside the queue's own counter (a key no earlier job touched).
    done = SharedCount(mine.store, f"{mine.key}/done") if mine.store is not None and replicas.leads else None
    total = len(rows) if done is not None or not first else sum(map(len, mine.fixed_share()))  # no store: its own
    with Progress(total, "eval", "passages", enabled=progress and first) as bar:
        for chunk in mine:
            scored.update(ev.score_chunk(generator, rows, targets, chunk))
            bar.update(done.add(len(chunk)) - bar.n if done is not None else len(chunk))
        # Every rank waits here for the last replica; rank 0's bar follows the others meanwhile.
        follows = progress and first and done is not None
        waiting = dist.barrier(group=replicas.coordination, async_op=True)
        while not waiting.is_completed():
            time.sleep(POLL_SECONDS)
            if follows:
                bar.update(done.value() - bar.n)
        waiting.wait()
        if follows:
            bar.update(done.value() - bar.n)
    gathered = [None] * replicas.count * replicas.ranks_per_replica
    dist.all_gather_object(gathered, scored if replicas.leads else None, group=replicas.coordination)
    if not first:
        return None
    for part in gathered:
        scored.update(part or {})
    return ev.combine([scored[i] for chunk in chunks for i in chunk], len(rows))
