"""Writing results so that nothing already generated is lost.

``ResultWriter`` rewrites its JSON list after every batch, atomically (write a temporary file next
to the target, then rename; a device or FIFO is written through: see ``files.replace_file``), so a
run stopped at any moment leaves a valid file holding every finished batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..results import GenerationResult
from .files import replace_file


class ResultWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict] = []
        self._flush()  # fail now, not after the first batch, if the path cannot be written

    def add(self, results: list[GenerationResult]) -> None:
        self.records.extend(r.to_dict() for r in results)
        self._flush()

    def _flush(self) -> None:
        text = json.dumps(self.records, indent=2, ensure_ascii=False) + "\n"
        replace_file(self.path, text.encode("utf-8"))
