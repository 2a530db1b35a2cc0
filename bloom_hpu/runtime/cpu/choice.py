"""The faster of two correct paths, chosen by timing both on this CPU (DESIGN.md, principle 15).

Where two routes compute a product within the same contract (bf16 products or the weight widened
to fp32; weight-only or integer products of a quantized weight), which is faster depends on the
CPU (a Xeon whose ``VDPBF16PS`` is slow, a Zen 4 whose is fast, an AVX2 CPU that has none) and
on the row count. ``accelerate.py`` names the candidates of each shape class ('prompts': 32 and
128 rows; 'decode': 1, 4 and 16 rows) with a function that times one on the model's own shapes;
``choose`` takes the fastest of each class (medians of a few alternated repeats) and remembers it:

* **Cached beside the kernels, named by what determines it**: a file ``bloom_cpu_choice_<hash>.json``
  in the kernels' folder (``build.build_root()``; ``$BLOOM_CPU_CHOICE_DIR`` elsewhere), the hash of the CPU (its model name and flags,
  the caps of torch, oneDNN and MKL), the thread count, torch's build, the sources of the routes and
  the kernels, the shapes and dtypes timed and the candidates. A new CPU, thread count, model shape
  or source is timed afresh; the same machine reads its answer.
* **Appears whole or not at all**: the file is written to a temporary name beside it and renamed
  into place; a run killed while timing leaves nothing, one killed while writing leaves a temporary
  file that is never read (the next writer removes it), and the next run times again.

``CpuOptions.choice`` or ``$BLOOM_CPU_CHOICE`` (the option wins): 'measure' (default: cached, else
timed), 'static' (no timing: the rule of thumb, today's defaults before measuring: widened fp32
where bf16 products are emulated, weight-only quantized products), or a forced choice
'prompts=widened,decode=integer' (an error where a candidate named cannot run here).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import capability
from .build import build_root

CHOICE_ENV = "BLOOM_CPU_CHOICE"
DIR_ENV = "BLOOM_CPU_CHOICE_DIR"  # where the file goes, if not beside the kernels (tests)
MODES = ("measure", "static")
CLASSES = ("prompts", "decode")
PROMPT_ROWS = (8, 32, 128)
DECODE_ROWS = (1, 4, 16)
REPEATS = 3  # alternated, after one warm-up call of each candidate: the median of three
PRUNED = 3.0  # a candidate whose warm-up call took this many times the fastest one's is not timed again
# Environment switches that change which instructions torch, oneDNN and MKL run.
CAP_ENVS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "DNNL_MAX_CPU_ISA")
# The Python sources whose routes are timed: a change to them is a new file.
ROUTE_SOURCES = ("accelerate.py", "layers.py", "choice.py", "../../quantize.py", "../../int8_activations.py",
                 "../../int4.py")


class ChoiceError(ValueError):
    """A forced choice that names an unknown class or a candidate that cannot run here."""


@dataclass(frozen=True)
class Chosen:
    """``picks``: class -> candidate; ``how``: 'measured', 'cached', 'static' or 'forced';
    ``times``: class -> candidate -> median seconds (measured or cached), for the load line."""

    picks: dict
    how: str
    times: dict
    path: Path | None = None

    def describe(self) -> str:
        picks = ", ".join(f"{c} {p}" for c, p in self.picks.items())
        return f"{picks} ({self.how})" if picks else ""


def mode(option: str | None) -> str:
    """The choice mode in force: the option, else ``$BLOOM_CPU_CHOICE``, else 'measure'."""
    return option or os.environ.get(CHOICE_ENV, "").strip() or "measure"


def parse_forced(text: str) -> dict[str, str]:
    """'prompts=widened,decode=integer' -> {'prompts': 'widened', 'decode': 'integer'}."""
    forced = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in CLASSES or not value.strip():
            raise ChoiceError(f"bad CPU choice {part!r}: give 'measure', 'static' or class=candidate pairs "
                              f"(classes: {', '.join(CLASSES)})")
        forced[name.strip()] = value.strip()
    return forced


def check(option: str | None) -> None:
    """Raise ChoiceError for a choice mode that is neither a mode nor well-formed pairs."""
    chosen = mode(option)
    if chosen not in MODES:
        parse_forced(chosen)


def choose(candidates: dict[str, dict[str, Callable[[], float]]], static: dict[str, str],
           determined_by: dict, option: str | None = None) -> Chosen:
    """The pick of each class of ``candidates`` (class -> name -> a function timing that candidate
    once, in seconds); ``static``: the rule-of-thumb pick of each class; ``determined_by``: what
    besides the CPU and the sources the answer depends on (shapes, dtypes, options), for the name."""
    classes = {c: names for c, names in candidates.items() if names}
    chosen = mode(option)
    if chosen == "static":
        return Chosen({c: static[c] for c in classes}, "static", {})
    if chosen != "measure":
        forced = parse_forced(chosen)
        for c, pick in forced.items():
            if c in classes and pick not in classes[c]:
                raise ChoiceError(f"CPU choice {c}={pick} cannot run here: choose one of {', '.join(classes[c])}")
        return Chosen({c: forced.get(c, static[c]) for c in classes}, "forced", {})
    timed = {c: names for c, names in classes.items() if len(names) > 1}
    picks = {c: next(iter(names)) for c, names in classes.items() if len(names) == 1}
    if not timed:
        return Chosen(picks, "only one", {})
    path = cache_path({**determined_by, "candidates": {c: sorted(n) for c, n in timed.items()}})
    cached = read(path, timed)
    if cached is not None:
        return Chosen({**picks, **cached["picks"]}, "cached", cached["times"], path)
    times = {c: measure(names) for c, names in timed.items()}
    fastest = {c: min(t, key=t.get) for c, t in times.items()}
    write(path, {"picks": fastest, "times": times, "cpu": cpu_model(), "threads": torch.get_num_threads(),
                 "why": capability.detect().why, "load_average": os.getloadavg()[0]})
    return Chosen({**picks, **fastest}, "measured", times, path)


def measure(candidates: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Median seconds of each candidate: one warm-up call each, then ``REPEATS`` rounds, the
    candidates alternated within a round so that a change of load falls on all of them. A candidate
    ``PRUNED`` times slower than the fastest at warm-up keeps that one time (it cannot win)."""
    warm = {name: run() for name, run in candidates.items()}
    fastest = min(warm.values())
    rounds = {name: [] for name in candidates if warm[name] <= PRUNED * fastest}
    for _ in range(REPEATS):
        for name in rounds:
            rounds[name].append(candidates[name]())
    return {name: statistics.median(rounds[name]) if name in rounds else warm[name] for name in candidates}


def timed(call: Callable[[], object]) -> float:
    """Seconds ``call`` takes once."""
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def cache_path(determined_by: dict) -> Path:
    """``bloom_cpu_choice_<hash>.json`` in the kernels' folder, the hash of everything that decides
    the timings besides ``determined_by``: this CPU, the caps in force, threads, torch, the sources."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    parts = {
        "cpu": cpu_model(), "flags": sorted(capability.cpu_flags() or ()), "capability": repr(capability.detect()),
        "caps": {name: os.environ.get(name, "") for name in CAP_ENVS}, "threads": torch.get_num_threads(),
        "torch": [torch.__version__, str(torch.version.git_version)], **determined_by,
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    for source in (*ROUTE_SOURCES, *sorted(p.name for p in (here / "csrc").glob("*") if p.suffix in (".h", ".cpp"))):
        path = here / source if not source.endswith((".h", ".cpp")) else here / "csrc" / source
        h.update(source.encode() + b"\0" + path.read_bytes() + b"\0")
    return (Path(os.environ.get(DIR_ENV) or build_root())) / f"bloom_cpu_choice_{h.hexdigest()[:16]}.json"


def read(path: Path, classes: dict[str, dict]) -> dict | None:
    """The cached picks and times, or None where the file is missing, unreadable or names a
    class or candidate that is not among ``classes`` (then it is timed again)."""
    try:
        saved = json.loads(path.read_text())
        picks, times = saved["picks"], saved["times"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(picks, dict) or set(picks) != set(classes) or \
            any(picks[c] not in classes[c] for c in classes):
        return None
    return {"picks": picks, "times": times}


def write(path: Path, content: dict) -> None:
    """``content`` as ``path``, whole or not at all: written to a temporary name in the same folder,
    flushed to disk, renamed into place; then the temporary files of earlier writers that died
    before their rename are removed. A folder that cannot be written only costs the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(content, out, indent=1, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except OSError:
        return
    for leftover in path.parent.glob(f".{path.stem}.*.tmp"):
        try:
            leftover.unlink()
        except OSError:
            pass
