"""The faster of two correct paths, chosen by timing both on this CPU (DESIGN.md, principle 15).

Where two routes compute a product within the same contract (bf16 products or the weight widened
to fp32; weight-only or integer products of a quantized weight), which is faster depends on the
CPU (a Xeon whose ``VDPBF16PS`` is slow, a Zen 4 whose is fast, an AVX2 CPU that has none) and
on the row count. ``routes.py`` names the candidates of each key (a prompt bucket of rows,
'prompts:1-16', 'prompts:17-64', 'prompts:65+'; 'decode') with a function that times one on the
model's own shapes; ``choose`` takes the fastest of each key (the best of a few alternated repeats)
and remembers it:

* **Cached beside the kernels, named by what determines it**: a file ``bloom_cpu_choice_<hash>.json``
  in the kernels' folder (``build.build_root()``; ``$BLOOM_CPU_CHOICE_DIR`` elsewhere), the hash of the CPU (its model name and flags,
  the caps of torch, oneDNN and MKL), the thread count, torch's build, the sources of the routes and
  the kernels, the shapes and dtypes timed and the candidates. A new CPU, thread count, model shape
  or source is timed afresh; the same machine reads its answer.
* **Appears whole or not at all**: the file is written to a temporary name beside it and renamed
  into place; a run killed while timing leaves nothing, one killed while writing leaves a temporary
  file that is never read (the next writer removes it), and the next run times again.
* **Provisional when timed on a busy machine**: the file records the 1-minute load average, the
  CPU count and the time; a pick timed with the load above ``BUSY`` per CPU is provisional (said in
  the load line) and timed again by the first later run that starts on a quieter machine.
* **One pick for every rank**: under tensor parallelism rank 0 chooses and the other ranks of the
  model's group take its choice (``agree``): ranks that routed differently would compute different
  tokens from their halves of a product.

``CpuOptions.choice`` or ``$BLOOM_CPU_CHOICE`` (the option wins): 'measure' (default: cached, else
timed), 'static' (no timing: the rule of thumb, today's defaults before measuring: widened fp32
where bf16 products are emulated, weight-only quantized products), or a forced choice
'prompts=widened,decode=integer' (a class names all its buckets that offer the candidate;
'prompts:65+=widened' one; an error where a candidate named cannot run here).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...tp import DistributedParallel
from . import capability
from .build import build_root

CHOICE_ENV = "BLOOM_CPU_CHOICE"
DIR_ENV = "BLOOM_CPU_CHOICE_DIR"  # where the file goes, if not beside the kernels (tests)
MODES = ("measure", "static")
CLASSES = ("prompts", "decode")  # a key is a class, or a class and a bucket: 'prompts:17-64'
BUSY = 0.5  # a 1-minute load average above this many per CPU: the machine is busy
REPEATS = 5  # alternated, after one warm-up call of each candidate: the fastest of five
PRUNED = 3.0  # a candidate whose warm-up call and one more took this many times the fastest one's: not timed again
# Environment switches that change which instructions torch, oneDNN and MKL run.
CAP_ENVS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "DNNL_MAX_CPU_ISA")
# The Python sources whose routes are timed: a change to them is a new file.
ROUTE_SOURCES = ("accelerate.py", "layers.py", "choice.py", "routes.py", "../../quantize.py", "../../int8_activations.py",
                 "../../int4.py")


class ChoiceError(ValueError):
    """A forced choice that names an unknown class or a candidate that cannot run here."""


@dataclass(frozen=True)
class Chosen:
    """``picks``: key -> candidate; ``how``: 'measured', 'cached', 'static' or 'forced';
    ``times``: key -> candidate -> best seconds (measured or cached); ``provisional``: timed on
    a busy machine (``BUSY``)."""

    picks: dict
    how: str
    times: dict
    path: Path | None = None
    provisional: bool = False

    def describe(self) -> str:
        """'prompts widened, decode native (measured)'; a class whose buckets differ lists them:
        'prompts 1-16 native, 17-64 widened, 65+ widened, decode native (cached, provisional)'."""
        parts = []
        for name in CLASSES:
            keys = [k for k in self.picks if class_of(k) == name]
            if len({self.picks[k] for k in keys}) == 1:
                parts.append(f"{name} {self.picks[keys[0]]}")
            elif keys:
                parts.append(f"{name} " + ", ".join(f"{k.partition(':')[2]} {self.picks[k]}" for k in keys))
        how = f"{self.how}, provisional" if self.provisional else self.how
        return f"{', '.join(parts)} ({how})" if parts else ""


def class_of(key: str) -> str:
    return key.partition(":")[0]


def mode(option: str | None) -> str:
    """The choice mode in force: the option, else ``$BLOOM_CPU_CHOICE``, else 'measure'."""
    return option or os.environ.get(CHOICE_ENV, "").strip() or "measure"


def parse_forced(text: str) -> dict[str, str]:
    """'prompts=widened,decode=integer' -> {'prompts': 'widened', 'decode': 'integer'}; a bucket's
    key may stand for its class: 'prompts:65+=widened'."""
    forced = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or class_of(name.strip()) not in CLASSES or not value.strip():
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
           determined_by: dict, option: str | None = None, together: tuple[str, ...] = ()) -> Chosen:
    """The pick of each key of ``candidates`` (key -> name -> a function timing that candidate
    once, in seconds); ``static``: the rule-of-thumb pick of each key; ``determined_by``: what
    besides the CPU and the sources the answer depends on (shapes, dtypes, options), for the name;
    ``together``: names picked for every key of a class or for none (``settle``)."""
    keys = {k: names for k, names in candidates.items() if names}
    chosen = mode(option)
    if chosen == "static":
        return Chosen({k: static[k] for k in keys}, "static", {})
    if chosen != "measure":
        return Chosen(forced_picks(parse_forced(chosen), keys, static, together), "forced", {})
    timed = {k: names for k, names in keys.items() if len(names) > 1}
    picks = {k: next(iter(names)) for k, names in keys.items() if len(names) == 1}
    if not timed:
        return Chosen(picks, "only one", {})
    path = cache_path({**determined_by, "candidates": {k: sorted(n) for k, n in timed.items()}})
    load = load_average()
    busy = load is not None and load > BUSY * (os.cpu_count() or 1)
    cached = read(path, timed)
    if cached is not None and not (cached["provisional"] and not busy):  # a provisional pick: timed again when quiet
        return Chosen({**picks, **cached["picks"]}, "cached", cached["times"], path, cached["provisional"])
    started = time.perf_counter()
    times = {k: measure(names) for k, names in timed.items()}
    fastest = settle(times, together)
    write(path, {"picks": fastest, "times": times, "cpu": cpu_model(), "threads": torch.get_num_threads(),
                 "why": capability.detect().why, "load_average": load, "cpus": os.cpu_count(),
                 "provisional": busy, "timed_at": time.time(), "seconds": time.perf_counter() - started})
    return Chosen({**picks, **fastest}, "measured", times, path, busy)


def forced_picks(forced: dict[str, str], keys: dict[str, dict], static: dict[str, str],
                 together: tuple[str, ...]) -> dict[str, str]:
    """Each key's forced candidate (its own, else its class's where the key offers it, else the
    static one); a ChoiceError where one cannot run here (named for a key that does not offer it,
    or for a class none of whose keys does), or a ``together`` name is forced on part of a class."""
    for name in forced:
        buckets = [k for k in keys if class_of(k) == class_of(name) and k != class_of(k)]
        if name not in keys and name != class_of(name) and buckets:
            raise ChoiceError(f"CPU choice {name}: no such bucket; choose one of {', '.join(buckets)}")
    picks = {k: forced.get(k, forced.get(class_of(k), static[k])) for k in keys}
    for k, pick in picks.items():
        if pick in keys[k] or not (k in forced or class_of(k) in forced):
            continue
        offered = any(pick in keys[other] for other in keys if class_of(other) == class_of(k))
        if k not in forced and offered:  # a class's name goes to its buckets that offer it
            picks[k] = static[k]
        else:
            raise ChoiceError(f"CPU choice {k}={pick} cannot run here: choose one of {', '.join(keys[k])}")
    for name in together:
        for group in CLASSES:
            chose = {picks[k] == name for k in picks if class_of(k) == group}
            if len(chose) > 1:
                raise ChoiceError(f"CPU choice: {name} products go to every {group} bucket or none")
    return picks


def settle(times: dict[str, dict[str, float]], together: tuple[str, ...] = ()) -> dict[str, str]:
    """The fastest candidate of each key; a name of ``together`` that some keys of a class would
    pick is picked for all of that class's keys that have it, or for none: whichever of the two
    takes less time summed over those keys."""
    picks = {k: min(t, key=t.get) for k, t in times.items()}
    for name in together:
        for group in CLASSES:
            keys = [k for k in times if class_of(k) == group and name in times[k] and len(times[k]) > 1]
            if not any(picks[k] == name for k in keys):
                continue
            others = {k: min((n for n in times[k] if n != name), key=times[k].get) for k in keys}
            if sum(times[k][name] for k in keys) <= sum(times[k][others[k]] for k in keys):
                picks.update({k: name for k in keys})
            else:
                picks.update(others)
    return picks


def agree(parallel, decide: Callable[[], Chosen]) -> Chosen:
    """``decide()`` on rank 0 of the model's ranks (``parallel``: ``bloom_hpu.tp.Parallel``), its
    answer taken by every rank of the group (``broadcast_object_list``, gloo on the CPU): timings
    differ from rank to rank, and ranks that routed a product differently would not compute the
    same tokens. A rank 0 that cannot choose makes every rank raise ChoiceError. A ``Parallel``
    with no process group (one process standing in for a rank) decides alone."""
    if parallel.world_size <= 1 or not isinstance(parallel, DistributedParallel):
        return decide()
    import torch.distributed as dist

    answer = [None]
    failure = None
    if parallel.rank == 0:
        try:
            answer = [(decide(), None)]
        except Exception as error:  # noqa: BLE001: sent to the other ranks, then raised here
            failure = error
            answer = [(None, str(error) if isinstance(error, ChoiceError) else
                       f"rank 0 could not choose the CPU routes ({type(error).__name__}: {error})")]
    dist.broadcast_object_list(answer, group=getattr(parallel, "group", None), group_src=0)
    if failure is not None:
        raise failure
    chosen, error = answer[0]
    if error is not None:
        raise ChoiceError(error)
    return chosen


def measure(candidates: dict[str, Callable[[], float]]) -> dict[str, float]:
    """The best seconds of each candidate: one warm-up call each, then ``REPEATS`` rounds, the
    candidates alternated within a round so that a change of load falls on all of them. The best,
    not the median: other work on the machine only ever adds time, so a candidate's fastest round is
    the nearest to its own speed, where a median lets a few disturbed rounds decide. A candidate
    ``PRUNED`` times slower than the fastest at warm-up, and again in a second call, keeps the
    faster of those two times (it cannot win); one slow first call (a page fault, a thread waking)
    does not drop a candidate, nor, by its time, turn a choice made for a whole class."""
    warm = {name: run() for name, run in candidates.items()}
    fastest = min(warm.values())
    for name in [name for name in candidates if warm[name] > PRUNED * fastest]:
        warm[name] = min(warm[name], candidates[name]())
    rounds = {name: [] for name in candidates if warm[name] <= PRUNED * fastest}
    for _ in range(REPEATS):
        for name in rounds:
            rounds[name].append(candidates[name]())
    return {name: min(rounds[name]) if name in rounds else warm[name] for name in candidates}


def timed(call: Callable[[], object]) -> float:
    """Seconds ``call`` takes once."""
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def cpu_model() -> str:
    return capability.cpuinfo_field("model name") or "unknown CPU"


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


def read(path: Path, keys: dict[str, dict]) -> dict | None:
    """The cached picks, times and whether they are provisional, or None where the file is
    missing, unreadable or names a key or candidate that is not among ``keys`` (then it is timed
    again)."""
    try:
        saved = json.loads(path.read_text())
        picks, times, provisional = saved["picks"], saved["times"], saved["provisional"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(picks, dict) or set(picks) != set(keys) or any(picks[k] not in keys[k] for k in keys) or \
            not isinstance(provisional, bool):
        return None
    return {"picks": picks, "times": times, "provisional": provisional}


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
