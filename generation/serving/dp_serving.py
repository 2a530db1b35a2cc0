"""``--serve --data_parallel D``: where each replica listens, agreed before the weights load.

Every replica's leader (rank 0 of its tensor-parallel group) serves its replica as one process
would (``app.serve``), on a port the system chooses; its followers follow it over the replica's
own process group (``tp_serving.py``). Global rank 0 also binds the user's ``--port`` for the
front door (``replicas.py``), which reaches every replica over HTTP:

* a leader on global rank 0's node listens on loopback;
* a leader on another node listens on the address of its interface toward the launch's master
  (``MASTER_ADDR``, where the launcher's rendezvous runs, on the first node): the network the
  launch itself already crosses. A node is a machine and the launcher that started the rank
  (torchrun's ``GROUP_RANK``, deepspeed's ``CROSS_RANK``), so two launchers on one machine are two
  nodes, as the tests run them.

Ranks first learn global rank 0's node, then bind, then exchange the ports with one
``all_gather_object`` over the launch's gloo coordination group (what the launcher gives; nothing
else crosses ranks), so a busy ``--port`` is one error line on every rank within seconds, before
anything slow.
"""

from __future__ import annotations

import os
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


def node_of(environ=None) -> tuple[str, str]:
    """This rank's node: its machine's name and its launcher's node rank (empty when not told)."""
    environ = os.environ if environ is None else environ
    return socket.gethostname(), environ.get("GROUP_RANK", environ.get("CROSS_RANK", ""))


def facing_address(master: str) -> str | None:
    """The address of this machine's interface on the route to ``master`` (the kernel's choice of
    source address; a UDP connect sends nothing), or None when there is no route or no such host."""
    try:
        family, _, _, _, where = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            return probe.getsockname()[0]
    except (OSError, UnicodeError):
        return None


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def replica_address(same_node: bool, environ=None) -> str:
    """Where a replica's leader listens: loopback on the front door's node, else toward the master."""
    environ = os.environ if environ is None else environ
    if same_node:
        return LOOPBACK
    master = environ.get("MASTER_ADDR", "")
    address = facing_address(master) if master else None
    if address is None:
        raise ListenError(f"a replica on another node than global rank 0's listens on its address toward the launch's "
                          f"master, but MASTER_ADDR {master!r} cannot be reached from {socket.gethostname()}")
    return address


def open_listeners(host: str, port: int, replicas, leads: bool, environ=None) -> Listeners:
    """Bind this rank's ports and learn every replica's; a ListenError (the same on every rank)
    when a port cannot be bound."""
    group = replicas.coordination
    nodes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, node_of(environ), group=group)
    front = mine = None
    problem, address = None, None
    try:
        if replicas.world_rank == 0:
            front = bind(host, port)
        if leads:
            address = replica_address(nodes[replicas.world_rank] == nodes[0], environ)
            mine = bind(address, 0)
    except ListenError as error:
        problem = f"rank {replicas.world_rank}: {error}"
    said = (address, mine.getsockname()[1] if mine is not None else None, problem)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, said, group=group)
    problems = [p for _, _, p in everyone if p]
    if problems:
        for sock in (front, mine):
            if sock is not None:
                sock.close()
        raise ListenError(problems[0])
    return Listeners(mine, front, [url(a, p) for a, p, _ in everyone if p is not None])
