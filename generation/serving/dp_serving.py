"""``--serve --data_parallel D``: where each replica listens, agreed before the weights load.

Every replica's leader (rank 0 of its tensor-parallel group) serves its replica as one process
would (``app.serve``), on a loopback port the system chooses; its followers follow it over the
replica's own process group (``tp_serving.py``). Global rank 0 also binds the user's ``--port`` for the front door
(``replicas.py``). The ports are bound first, then exchanged with one ``all_gather_object`` over
the launch's gloo coordination group (what the launcher gives; nothing else crosses ranks), so a
busy ``--port`` is one error line on every rank within seconds, before anything slow.

The front door reaches the replicas over loopback HTTP, so every replica leader must be on global
rank 0's machine: serving with replicas on other nodes is refused with one line (left to do).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist

from .listen import ListenError, bind

LOOPBACK = "127.0.0.1"


@dataclass
class Listeners:
    replica: socket.socket | None  # this replica's internal port (its leader only)
    front: socket.socket | None  # the user's --port (global rank 0 only)
    urls: list[str]  # each replica's base URL, in replica order


def open_listeners(host: str, port: int, replicas, leads: bool) -> Listeners:
    """Bind this rank's ports and learn every replica's; a ListenError (the same on every rank)
    when a port cannot be bound or a replica leader is on another machine."""
    front = mine = None
    problem = None
    try:
        if replicas.world_rank == 0:
            front = bind(host, port)
        if leads:
            mine = bind(LOOPBACK, 0)
    except ListenError as error:
        problem = f"rank {replicas.world_rank}: {error}"
    said = (socket.gethostname(), mine.getsockname()[1] if mine is not None else None, problem)
    everyone: list = [None] * dist.get_world_size(replicas.coordination)
    dist.all_gather_object(everyone, said, group=replicas.coordination)
    problems = [p for _, _, p in everyone if p]
    leaders = [(rank, h, p) for rank, (h, p, _) in enumerate(everyone) if p is not None]
    if not problems:
        here = everyone[0][0]
        away = [f"replica {rank // replicas.ranks_per_replica} on {h}" for rank, h, _ in leaders if h != here]
        if away:
            problems = [f"--serve --data_parallel reaches its replicas over loopback; every replica's rank 0 must "
                        f"run on global rank 0's machine ({here}), but {', '.join(away)}"]
    if problems:
        for sock in (front, mine):
            if sock is not None:
                sock.close()
        raise ListenError(problems[0])
    return Listeners(mine, front, [f"http://{LOOPBACK}:{p}" for _, _, p in leaders])
