"""Tensor parallelism, in one place: how a run of N ranks splits BLOOM and talks between ranks.

* ``Parallel``: what the model asks of its peers: its rank and world size, which vocabulary rows it
  holds, and two collectives. ``SINGLE`` is the one-process case, where every collective is the
  identity; ``DistributedParallel`` runs them through torch.distributed.
* The two parallel layers the model is built from: ``RowParallelLinear`` (input features split,
  partial sums all-reduced) and ``VocabParallelEmbedding`` (vocabulary rows split). The other
  linears are column-parallel: plain linears with fewer output rows, nothing to exchange.
* ``shard_slices``: the sharding plan, which rows or columns of each checkpoint tensor a rank reads.
* Joining the launcher's process group (``init_parallel``: the `deepspeed` launcher or `torchrun`
  start one process per card and describe it in the environment), and the checks and output
  routing of a multi-rank run: heads must split evenly (the vocabulary need not), every rank must have been given the
  same arguments, rank 0 prints.

Both collectives give every rank bitwise the same result, so all ranks choose the same tokens: an
all-reduce ends with every rank holding one reduced copy, and the all-gather concatenates in rank
order.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import BloomConfig

if TYPE_CHECKING:
    from .model import StaticBloom


# --- what the model asks of its peers -------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # device index on this host

    def vocab_shard(self, vocab_size: int) -> int:
        """Vocabulary rows every rank holds: ceil(vocab_size / world_size). Where the vocabulary does
        not divide, the last rank's shard ends in zero pad rows (as Megatron and DeepSpeed pad),
        so every shard has one shape and the gather of the logits stays a plain all_gather."""
        return -(-vocab_size // self.world_size)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows this rank holds (equal blocks, the last may be
        short; its shard is padded up to ``vocab_shard``)."""
        per_rank = self.vocab_shard(vocab_size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order), keeping the first
        ``size`` columns: the pad columns of a padded vocabulary are dropped, so no pad id can ever
        be chosen or scored."""
        return x if size is None or x.shape[-1] == size else x[..., :size]


SINGLE = Parallel()


@dataclass(frozen=True)
class DistributedParallel(Parallel):
    """Collectives over the default torch.distributed process group (initialised by the caller).

    The collectives are the plain in-place c10d ones: CUDA graphs can capture NCCL calls, and HPU
    graphs capture hccl calls when PT_HPU_ENABLE_LAZY_COLLECTIVES is set (see runtime/backends.py).
    """

    device: str = "cpu"  # where the collective backend takes tensors: cpu (gloo), cuda:i, hpu

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x is always a fresh activation (a matmul output), so reducing in place is safe.
        torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        # Every rank holds the same number of vocabulary rows (the last shard is padded, see
        # vocab_shard), so the pieces have equal shapes, as all_gather requires.
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(pieces, x)
        out = torch.cat(pieces, dim=-1)
        return out if size is None or out.shape[-1] == size else out[..., :size].contiguous()


# --- the parallel layers ----------------------------------------------------------------------------


class RowParallelLinear(nn.Linear):
    """A linear whose input features are split across ranks: partial sums are all-reduced, and the
    bias (kept whole on every rank) is added once, after the reduction. Its product is one method,
    as the model's ``Linear``'s, for the runtime's kernels."""

    def __init__(self, in_features: int, out_features: int, parallel: Parallel):
        super().__init__(in_features, out_features)
        self.parallel = parallel

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self.product(x, self.bias)
        return self.parallel.all_reduce(self.product(x, None)) + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Word embeddings split by vocabulary rows across ranks (the LM head reuses them, tied).

    Every rank holds ``vocab_shard`` rows; on the last rank those past ``vocab_end`` are zero pad
    rows that no id looks up (ids outside the real range are masked) and whose logits the gather
    drops."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel):
        self.vocab_start, self.vocab_end = parallel.vocab_range(vocab_size)
        super().__init__(parallel.vocab_shard(vocab_size), hidden_size)
        self.parallel = parallel

    def forward(self, ids):
        if self.parallel.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return self.parallel.all_reduce(out)


# --- the sharding plan ------------------------------------------------------------------------------


def shard_slices(name: str, model: "StaticBloom") -> tuple[slice | None, slice | None]:
    """(rows, cols) of checkpoint tensor ``name`` that this rank holds; None means all.

    Column-parallel weights (fused QKV by whole heads, dense_h_to_4h) split their output rows;
    row-parallel ones (attention dense, dense_4h_to_h) split their input columns and keep the bias
    whole; the word embeddings split vocabulary rows. Everything else is replicated.
    """
    par, cfg = model.parallel, model.config
    if par.world_size == 1:
        return None, None

    def block(total: int) -> slice:
        per = total // par.world_size
        return slice(par.rank * per, (par.rank + 1) * per)

    if name == "word_embeddings.weight":
        return slice(*par.vocab_range(cfg.vocab_size)), None
    if ".self_attention.query_key_value." in name:
        # Rows are laid out [head, (q, k, v), head_dim]: whole heads are contiguous row blocks.
        return block(3 * cfg.hidden_size), None
    if ".mlp.dense_h_to_4h." in name:
        return block(4 * cfg.hidden_size), None
    if name.endswith(".self_attention.dense.weight"):
        return None, block(cfg.hidden_size)
    if name.endswith(".mlp.dense_4h_to_h.weight"):
        return None, block(4 * cfg.hidden_size)
    return None, None


# --- joining a run, and what a run of several ranks checks and prints -------------------------------


COLLECTIVE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}


class ParallelError(ValueError):
    """A tensor-parallel run cannot go on. Every rank raises the same one, so rank 0 alone reports it."""


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


def check_splittable(config: BloomConfig, world_size: int) -> None:
    """Tensor parallelism splits heads and the MLP in equal whole parts (any vocabulary splits: its
    last shard is padded)."""
    if world_size <= 1:
        return
    if world_size > config.n_head:
        raise ParallelError(
            f"{world_size} ranks is more than the model's {config.n_head} attention heads; "
            f"run on at most {config.n_head} cards"
        )
    if config.n_head % world_size:
        divisors = [n for n in range(1, config.n_head + 1) if config.n_head % n == 0]
        raise ParallelError(
            f"the model's {config.n_head} attention heads cannot be split evenly over {world_size} ranks; "
            f"use a number of cards that divides {config.n_head}: {', '.join(map(str, divisors))}"
        )


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
    from .runtime import hpu_env
    from .runtime.backends import DeviceError, default_device

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
            COLLECTIVE_BACKENDS[kind], rank=info.rank, world_size=info.world_size
        )
    # On HPU each process sees its own card as hpu:0; on CUDA it is cuda:LOCAL_RANK.
    index = info.local_rank if kind == "cuda" else 0
    device_name = {"cpu": "cpu", "cuda": f"cuda:{index}", "hpu": "hpu"}[kind]
    return DistributedParallel(info.rank, info.world_size, index, device_name)


def shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _fingerprint(value) -> int:
    text = json.dumps(value, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


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
    seed = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
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
