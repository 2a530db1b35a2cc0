"""Writing results so that nothing already generated is lost.

``ResultWriter`` rewrites its JSON list after every batch, atomically (write a temporary file next
to the target, then rename: see ``files.replace_file``), so a run stopped at any moment leaves a
valid file holding every finished batch. A device or a FIFO cannot be rewritten: it gets the whole
list once, written through, when the run finishes (``finish``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..run.results import GenerationResult
from .files import is_regular_or_new, replace_file


class ResultWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict] = []
        # A FIFO or device would get one JSON list per batch, and opening a FIFO waits for its
        # reader: those are written once, at the end.
        self.rewritable = is_regular_or_new(self.path)
        if self.rewritable:
            self._flush()  # fail now, not after the first batch, if the path cannot be written

    def add(self, results: list[GenerationResult]) -> None:
        self.records.extend(r.to_dict() for r in results)
        if self.rewritable:
            self._flush()

    def finish(self) -> None:
        if not self.rewritable:
            self._flush()

    def _flush(self) -> None:
        text = json.dumps(self.records, indent=2, ensure_ascii=False) + "\n"
        replace_file(self.path, text.encode("utf-8"))
