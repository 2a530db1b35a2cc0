"""The engine's ``max_batch`` slots: which row sits in which, and the batch bucket they decode in.

A request takes ``params.rows`` free slots (sampled choices one row each; greedy choices are all
alike, so one row serves them) and gives them back when it ends. Decode runs over the smallest
batch bucket that holds every running row (``DeviceRows``: one cache per bucket), so its cost
follows the number of active rows, not ``max_batch``. Running rows are therefore kept in the lowest
slots (a finished row's place is taken by the highest one), and when the bucket changes their live
slots move to the other bucket's cache.
"""

from __future__ import annotations

from .device_rows import DeviceRows
from .handles import RequestHandle, Row
from .row_options import RowOptions


class Slots:
    """``rows[slot]``: the row in each slot, or None; ``bucket``: the batch bucket of the running
    rows (0: none). Moving a row moves its cache slots (``device_rows``) and its options (``opts``)."""

    def __init__(self, device_rows: DeviceRows, opts: RowOptions, backend, max_batch: int, stats: dict):
        self.device_rows = device_rows
        self.opts = opts
        self.backend = backend
        self.stats = stats  # the engine's: row_moves, bucket_changes
        self.rows: list[Row | None] = [None] * max_batch
        self.bucket = 0

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def idle(self) -> bool:
        return all(r is None for r in self.rows)

    def running(self) -> list[int]:
        """Slots of the rows that choose tokens (a row whose prompt is still joining does not)."""
        return [i for i, r in enumerate(self.rows) if r is not None and r.running]

    def slot_of(self, row: Row) -> int | None:
        return next((i for i, r in enumerate(self.rows) if r is row), None)

    def batch_bucket(self, rows: int) -> int:
        return next(b for b in self.device_rows.batch_sizes if b >= rows)

    def fit(self, taken: list[int] = ()) -> None:
        """Run in the bucket that holds every occupied slot and the slots ``taken`` (about to be)."""
        occupied = [i for i, r in enumerate(self.rows) if r is not None] + list(taken)
        self.resize(self.batch_bucket(max(occupied) + 1))

    def extent(self) -> int:
        """Slots written so far by any running row (what a move must copy), rounded up to its
        length bucket so that the copies keep a few shapes. With speculation, a verify pass whose
        tokens are not chosen yet (a move between it and the choice: a request joining) wrote up
        to ``verify_k`` slots past a row's last token, and the guesses the choice then accepts
        must come along: those slots count too."""
        written = max((r.written for r in self.rows if r is not None), default=0)
        if not written:
            return 0
        return self.device_rows.length_bucket(min(written + self.device_rows.verify_k, self.device_rows.max_length))

    def compact(self) -> None:
        """Keep running rows in the lowest slots, so the batch bucket can shrink as rows leave."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        if not live:
            self.bucket = 0
            return
        target = self.batch_bucket(len(live))
        extent = self.extent()
        while max(live) >= target:
            src, dst = max(live), self.rows.index(None)
            self.device_rows.move(self.bucket, src, dst, extent)
            self.opts.move_row(src, dst)
            self.backend.mark_step()
            self.rows[dst], self.rows[src] = self.rows[src], None
            self.stats["row_moves"] += 1
            live = [i for i, r in enumerate(self.rows) if r is not None]
        self.resize(target)

    def resize(self, bucket: int) -> None:
        """Run in the cache of ``bucket`` rows from now on; the running rows' live slots move over."""
        if bucket == self.bucket:
            return
        if self.bucket:
            self.device_rows.resize(self.bucket, bucket, self.extent())
            self.stats["bucket_changes"] += 1
        self.bucket = bucket

    def unseat(self, handles: list[RequestHandle]) -> None:
        """The rows of ``handles`` leave their slots (their requests failed)."""
        self.rows = [None if r is not None and any(r.handle is h for h in handles) else r for r in self.rows]

    def drop_cancelled(self) -> None:
        for i, row in enumerate(self.rows):
            if row is not None and row.handle.cancelled.is_set():
                self.rows[i] = None

    def clear(self) -> list[RequestHandle]:
        """Every row leaves; the requests they belonged to, once each."""
        handles = {id(r.handle): r.handle for r in self.rows if r is not None}
        self.rows = [None] * len(self.rows)
        self.bucket = 0
        return list(handles.values())
