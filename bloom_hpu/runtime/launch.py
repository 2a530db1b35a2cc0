"""Launching a tensor-parallel run: who this process is, joining the process group, agreeing, printing.

The `deepspeed` launcher (or `torchrun`) starts one process per card and describes it in the
environment. ``init_parallel`` reads that, prepares the device (CPU threads per rank, the CUDA
device, Habana's environment and hccl), joins the process group with the collective library of the
device, and returns the ``Parallel`` the model is built with (``bloom_hpu/tp.py``). The rest checks
that every rank was given the same arguments, draws one seed for all, and lets rank 0 alone print.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

from ..tp import SINGLE, DistributedParallel, Parallel, ParallelError
from . import hpu_env
from .backends import DeviceError, default_device

COLLECTIVE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}
# How long a rank waits in a collective before the run is declared broken (seconds).
DEFAULT_COLLECTIVE_TIMEOUT = 1800


def collective_timeout() -> float:
    """``BLOOM_COLLECTIVE_TIMEOUT`` seconds (default 1800, torch's gloo default): how long a rank
    waits for the others. An idle tensor-parallel server sends heartbeats well within it."""
    value = os.environ.get("BLOOM_COLLECTIVE_TIMEOUT", "")
    if not value:
        return DEFAULT_COLLECTIVE_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise ParallelError(f"BLOOM_COLLECTIVE_TIMEOUT={value!r} is not a positive number of seconds")
    return seconds


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    local_size: int  # processes on this host


def launch_info(environ=None) -> LaunchInfo | None:
    """Who this process is, from the launcher's environment; None when not launched as a group."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_size = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or world)
    except (KeyError, ValueError) as error:
        raise ParallelError(f"WORLD_SIZE is set but the launcher environment is incomplete ({error!r})") from None
    if not 0 <= rank < world:
        raise ParallelError(f"RANK {rank} is outside WORLD_SIZE {world}")
    return LaunchInfo(rank, world, local_rank, local_size)


def _set_cpu_threads(local_size: int) -> None:
    # Ranks on one host share its cores; without a split each would start one thread per core and
    # they would thrash. An explicit OMP_NUM_THREADS (torchrun sets 1) wins.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))


def init_parallel(device: str | None = None, environ=None) -> Parallel:
    """Join the launcher's process group and return this rank's ``Parallel`` (``SINGLE`` if alone).

    ``device`` is the device kind the run uses (cpu, cuda, hpu; None: the best available).
    """
    info = launch_info(environ)
    if info is None:
        return SINGLE
    kind = (device or default_device()).split(":")[0]
    if kind not in COLLECTIVE_BACKENDS:
        raise DeviceError(f"unknown device {device!r}: choose cpu, cuda or hpu")
    if kind == "cpu":
        _set_cpu_threads(info.local_size)
    elif kind == "cuda":
        if info.local_rank >= torch.cuda.device_count():
            raise DeviceError(f"rank {info.rank} wants cuda:{info.local_rank}, but this host has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(info.local_rank)
    else:
        # Read by the Gaudi runtime when it loads (bloom.py sets them before torch): graphs may then
        # hold collectives, and reductions run in a fixed order so every run gives the same tokens.
        late = hpu_env.set_defaults()
        if late:
            raise DeviceError(hpu_env.late_message(late))
        try:
            import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers the hccl backend)
        except ImportError as error:
            raise DeviceError(f"--device hpu was asked for, but Habana's hccl module is missing ({error})")

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            COLLECTIVE_BACKENDS[kind], rank=info.rank, world_size=info.world_size,
            timeout=datetime.timedelta(seconds=collective_timeout()),
        )
    # On HPU each process sees its own card as hpu:0; on CUDA it is cuda:LOCAL_RANK.
    index = info.local_rank if kind == "cuda" else 0
    return DistributedParallel(info.rank, info.world_size, index, collective_device(kind, index))


def collective_device(kind: str, index: int) -> str:
    """Where the collective library takes its tensors: gloo the CPU's, nccl and hccl the card's."""
    return {"cpu": "cpu", "cuda": f"cuda:{index}", "hpu": "hpu"}[kind]


def stop_together(timeout: float = 60.0) -> None:
    """Wait for every rank before stopping on an error they all raised (a ``ParallelError``).

    Only rank 0 prints such an error, and the launchers kill every rank as soon as one exits: a
    silent rank that left first would take rank 0 down before its line was written. A rank that
    does not come within ``timeout`` seconds is not waited for longer (gloo's monitored barrier;
    nccl and hccl have no timeout of their own here beyond the group's)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() <= 1:
        return
    try:
        if torch.distributed.get_backend() == "gloo":
            torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
        else:
            torch.distributed.barrier()
    except Exception:  # noqa: BLE001 - stopping anyway; the error was already reported
        pass


def shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``. A rank of a multi-process run ends with ``os._exit`` once its
    output is flushed: at interpreter exit a C++ destructor of the distributed stack sometimes aborts
    the process ("terminate called without an active exception"; about one 2-rank CPU run in ten,
    with PyTorch's own products as with our kernels, after everything was written), and the
    launcher then reports a finished run as failed."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _fingerprint(value) -> int:
    text = json.dumps(value, sort_keys=True, default=str)
    # 32 bits: the table travels through the card's collectives, and lazy mode on a Gaudi computes
    # int64 as int32 (a 64-bit hash would be cut there).
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little", signed=True)


def check_agreement(parallel: Parallel, values: dict) -> None:
    """Raise ParallelError on every rank unless all ranks passed equal ``values``.

    Ranks given different prompts or options would run different collectives and hang, or silently
    mix two runs. Each rank hashes every value and all ranks gather the hashes (a few bytes, not the
    values), so the message can name the arguments that differ and the ranks that differ on them.
    """
    if parallel.world_size <= 1:
        return
    names = sorted(values)
    # The list of names is hashed too, so ranks running different code disagree instead of hanging.
    mine = torch.tensor([_fingerprint(names)] + [_fingerprint(values[n]) for n in names], dtype=torch.int64)
    mine = mine.to(getattr(parallel, "device", "cpu"))  # nccl and hccl take device tensors
    gathered = [torch.empty_like(mine) for _ in range(parallel.world_size)]
    torch.distributed.all_gather(gathered, mine)
    table = torch.stack(gathered).cpu()  # [ranks, 1 + names]
    differs = (table != table[0]).any(dim=0).tolist()
    if not any(differs):
        return
    if differs[0]:
        raise ParallelError("ranks run different versions of the program (their argument lists differ)")
    bad = [n for n, d in zip(names, differs[1:]) if d]
    ranks = sorted({r for r in range(parallel.world_size) if (table[r] != table[0]).any()})
    who = f"rank {ranks[0]} differs" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} differ"
    raise ParallelError(
        f"ranks disagree on {', '.join(bad)} ({who} from rank 0); "
        "every rank must be started with the same arguments and inputs"
    )


def sync_random_seed(parallel: Parallel) -> None:
    """Seed torch's global generator alike on every rank, with a seed rank 0 draws.

    Sampling without --seed draws its seed from that generator; ranks that drew different seeds
    would pick different tokens and feed their halves of the model different inputs.
    """
    if parallel.world_size <= 1:
        return
    seed = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1], dtype=torch.int64)  # < 2**31: see _fingerprint
    seed = seed.to(getattr(parallel, "device", "cpu"))
    torch.distributed.broadcast(seed, src=0)
    torch.manual_seed(int(seed.item()))


class _RankPrefixed:
    """A text stream that starts every line with ``[rank r] `` (for --all_ranks output)."""

    def __init__(self, stream, prefix: str):
        self._stream = stream
        self._prefix = prefix
        self._line_start = True

    def write(self, text: str) -> int:
        out = []
        for line in text.splitlines(keepends=True):
            out.append((self._prefix if self._line_start else "") + line)
            self._line_start = line.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def route_output(parallel: Parallel, all_ranks: bool = False) -> bool:
    """Only rank 0 prints unless ``all_ranks``; other ranks' lines are then prefixed by their rank.

    Returns whether this rank prints its results and logs. Errors must still reach stderr from
    every rank (a failure on one rank alone would otherwise be invisible), so stderr is prefixed,
    never silenced.
    """
    if parallel.rank == 0:
        return True
    prefix = f"[rank {parallel.rank}] "
    sys.stderr = _RankPrefixed(sys.stderr, prefix)
    sys.stdout = _RankPrefixed(sys.stdout, prefix) if all_ranks else open(os.devnull, "w")
    return all_ranks
