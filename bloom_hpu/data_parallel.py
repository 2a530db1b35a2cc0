"""Data parallelism over tensor-parallel groups: a launch of N ranks as D model replicas of N/D ranks.

The launcher (deepspeed, torchrun, on one node or many) starts N processes in one world. With
``--data_parallel D`` the world is cut into D consecutive blocks of T = N/D ranks; block g is
replica g. Each replica gets its own process group (``torch.distributed.new_group``) and a
``DistributedParallel`` over it, so the model's collectives stay inside the replica and never wait
on another replica's. Consecutive blocks keep a replica on one node when nodes hold a multiple of T
ranks (the launchers number ranks node by node).

Replicas coordinate through one more group, ``coordination``: gloo, whatever the device, since it
carries small Python objects (who answered what, the final counts) between replica leaders, and
with a long timeout, since a replica that finishes its share first waits there for the others.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from .runtime.launch import collective_timeout
from .tp import DistributedParallel, Parallel, ParallelError

# A replica that finished its share waits this long for the slowest one (a share can take hours).
COORDINATION_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Replicas:
    """Where this process stands among the replicas."""

    index: int = 0  # this process's replica
    count: int = 1  # D
    world_rank: int = 0  # rank in the whole launch
    coordination: object = None  # gloo group of the whole world (None when count == 1)
    ranks_per_replica: int = 1  # T

    @property
    def leader(self) -> int:
        """The global rank of this replica's rank 0."""
        return self.index * self.ranks_per_replica

    @property
    def leads(self) -> bool:
        """Rank 0 of its replica: the rank that writes the replica's answers."""
        return self.world_rank % self.ranks_per_replica == 0


SINGLE_REPLICA = Replicas()


def check_data_parallel(world_size: int, data_parallel: int) -> int:
    """T, the ranks per replica; a ParallelError (the same on every rank) when D does not fit."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ParallelError(f"--data_parallel must be an integer >= 1, got {data_parallel!r}")
    if world_size == 1 and data_parallel > 1:
        raise ParallelError(f"--data_parallel {data_parallel} needs a launch of {data_parallel} ranks or a multiple: "
                            f"start it with deepspeed --num_gpus N or torchrun --nproc_per_node N")
    if world_size % data_parallel:
        raise ParallelError(
            f"--data_parallel {data_parallel} does not divide the {world_size} ranks of this launch: "
            f"each replica needs the same number of ranks (use a world size that is a multiple of {data_parallel})"
        )
    return world_size // data_parallel


def split_replicas(world: Parallel, data_parallel: int) -> tuple[Parallel, Replicas]:
    """This rank's tensor-parallel ``Parallel`` inside its replica, and its ``Replicas``.

    Every rank must call this (``new_group`` is collective: each rank creates every group, in the
    same order)."""
    per_replica = check_data_parallel(world.world_size, data_parallel)
    if data_parallel == 1:
        return world, Replicas(0, 1, world.rank, None, per_replica)
    index = world.rank // per_replica
    mine = None
    # The world's timeout (new_group's default is torch's own): a serving replica's heartbeats
    # (serving/tp_serving.py) are paced by it.
    timeout = datetime.timedelta(seconds=collective_timeout())
    for g in range(data_parallel):
        group = torch.distributed.new_group(list(range(g * per_replica, (g + 1) * per_replica)), timeout=timeout)
        if g == index:
            mine = group
    coordination = torch.distributed.new_group(backend="gloo", timeout=COORDINATION_TIMEOUT)
    replicas = Replicas(index, data_parallel, world.rank, coordination, per_replica)
    if per_replica == 1:
        # A replica of one rank runs the one-process path: no collective inside the model.
        return Parallel(0, 1, world.local_rank), replicas
    parallel = DistributedParallel(world.rank % per_replica, per_replica, world.local_rank,
                                   getattr(world, "device", "cpu"), mine)
    return parallel, replicas
