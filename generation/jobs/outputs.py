"""Writing results so that nothing already generated is lost.

``ResultWriter`` rewrites its JSON list after every batch, atomically (write a temporary file, then
rename), so a run stopped at any moment leaves a valid file holding every finished batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..results import GenerationResult


class ResultWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict] = []
        self._flush()  # fail now, not after the first batch, if the path cannot be written

    def add(self, results: list[GenerationResult]) -> None:
        self.records.extend(r.to_dict() for r in results)
        self._flush()

    def _flush(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.records, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
