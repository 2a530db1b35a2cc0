"""Part files of a data-parallel request job: where each replica's answers wait until they join the
results file.

Each replica's leader appends its records to ``RESULTS.replicaK.part`` (one write per batch,
flushed and fsynced, as the runner writes the results file); only the run's rank 0 touches the
results file itself. A part therefore holds answers that are safe on disk but not yet in the
results file, and every run on that results file, with any ``--data_parallel`` (1 included), folds
the parts it finds into the results file before it counts what is answered.

Folding is idempotent, so a kill at any moment of it (or of anything else) loses nothing and adds
nothing twice: it appends to the results file only the part lines the results file does not
already hold (as a multiset of exact lines), then deletes the parts. A kill in the middle of the
append leaves a torn last line, which the runner's repair cuts; the next fold appends what is still
missing. Records carry their batch's timing, so two answers are practically never the same bytes;
if they were, the answer is dropped from the fold and the rerun answers that request again: never
lost, never twice.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

from ..run.batch import InputError
from .files import disk_error, replace_file

_PART = re.compile(r"\.replica(\d+)\.part$")


def part_path(results_path: Path, replica: int) -> Path:
    return results_path.with_name(f"{results_path.name}.replica{replica}.part")


def find_parts(results_path: Path) -> list[Path]:
    """The part files beside ``results_path``, by replica index."""
    found = []
    for path in results_path.parent.glob(f"{glob_escape(results_path.name)}.replica*.part"):
        match = _PART.search(path.name[len(results_path.name):])
        if match and path.name == part_path(results_path, int(match.group(1))).name:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def record_lines(data: bytes, where: Path) -> list[bytes]:
    """The complete record lines of a file we append to (without their newlines). A last line without
    its newline is kept if it is a whole record and dropped if it is torn (a kill mid-write); any
    other line that is not a record means the file is not ours."""
    lines = data.split(b"\n")
    last = lines.pop()  # b"" when the data ends with a newline
    if last and _is_record(last):
        lines.append(last)
    for number, line in enumerate(lines, 1):
        if line.strip() and not _is_record(line):
            raise InputError(f"{where} line {number} is not a result record; fix or remove that file to resume")
    return [line for line in lines if line.strip()]


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line)["request"], dict)
    except (ValueError, KeyError, TypeError, RecursionError):
        return False


def fold_parts(results_path: Path, out) -> int:
    """Append to the results file (open as ``out``, locked, ending with a newline) the part lines it
    does not hold yet, then delete the parts. Returns the number of lines appended."""
    parts = find_parts(results_path)
    if not parts:
        return 0
    held = Counter(record_lines(results_path.read_bytes(), results_path)) if results_path.exists() else Counter()
    missing = []
    for part in parts:
        for line in record_lines(part.read_bytes(), part):
            if held[line] > 0:
                held[line] -= 1
            else:
                missing.append(line)
    if missing:
        try:
            out.write(b"".join(line + b"\n" for line in missing))
            out.flush()
            os.fsync(out.fileno())
        except OSError as error:
            raise disk_error(results_path, error) from None
    for part in parts:  # only once their lines are on disk in the results file
        part.unlink()
    return len(missing)


def rewrite_in_order(results_path: Path, position) -> None:
    """Rewrite the results file (atomically) with its records in the order ``position(record)``
    gives: the order one process writes, so a data-parallel job's file equals one process's.
    ``position`` returns None for a record the input does not ask for; those keep their order, last."""
    lines = record_lines(results_path.read_bytes(), results_path)
    keyed = [(position(json.loads(line)), n, line) for n, line in enumerate(lines)]
    inside = sorted((p, n, line) for p, n, line in keyed if p is not None)
    outside = [(p, n, line) for p, n, line in keyed if p is None]
    data = b"".join(line + b"\n" for _, _, line in inside + outside)
    if data != b"".join(line + b"\n" for line in lines):
        replace_file(results_path, data)


def settled_lines(results_path: Path) -> list[bytes]:
    """The record lines a fold would leave in the results file, read without writing: for the ranks
    that do not write, while rank 0 may be folding. The parts are read before the results file, so
    any moment of a fold gives the same lines (before: results + parts it lacks; after the append:
    results, which holds them; after the deletion: results)."""
    parts = [record_lines(part.read_bytes(), part) for part in find_parts(results_path) if part.exists()]
    try:
        held_lines = record_lines(results_path.read_bytes(), results_path)
    except FileNotFoundError:
        held_lines = []
    held = Counter(held_lines)
    extra = []
    for lines in parts:
        for line in lines:
            if held[line] > 0:
                held[line] -= 1
            else:
                extra.append(line)
    return held_lines + extra
