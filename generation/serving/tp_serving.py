"""Serving under tensor parallelism: rank 0 runs the engine and answers HTTP; the other ranks follow.

The engine decides everything on rank 0's host and reaches the model only through ``DeviceRows``
calls made of host values (``device_rows.py``). Rank 0 sends each such call, its name and its
arguments, to every other rank (one ``broadcast_object_list``) before making it itself; each other
rank makes the same call on its own shard. So every rank runs the same steps in the same order,
and the collectives inside the steps pair up. Only rank 0 reads the logits: the tokens it chose
come to the other ranks as the arguments of the next decode.

With data parallelism (``--serve --data_parallel D``) each replica is such a group of its own:
"rank 0" is the replica's first rank and the messages go over the replica's process group
(``group``, ``source``: that rank's global number, as torch's collectives name a source), so the
replicas' leaders send their steps side by side and never wait on each other.

An idle server sends nothing, and a follower waiting in a broadcast longer than the process
group's timeout (``BLOOM_COLLECTIVE_TIMEOUT``, ``runtime/launch.py``) would fail. So while idle the
engine calls ``idle()``, and rank 0 sends a heartbeat (a call the followers skip) whenever nothing
was sent for ``heartbeat_seconds`` — a quarter of the timeout — well before any follower times out.
A timeout therefore means a rank is gone: a follower whose rank 0 died ends with one line (gloo
notices the closed connection at once; NCCL and HCCL at the timeout), and the launcher stops the
others.

A call that fails on every rank alike (a bad request's prefill) fails on each and the ranks go on
in step. A failure on one rank alone leaves the others waiting in a collective until the timeout
ends them, as in any tensor-parallel run where one card fails.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from bloom_hpu.runtime.launch import collective_timeout

from .device_rows import DeviceRows
from .heap import freeze_long_lived

# The DeviceRows calls that touch the model or its caches: every rank makes them.
FOLLOWED = ("warm_up", "prefill", "decode", "mixed", "verify", "verify_mixed", "draft_step", "place", "move", "resize",
            "answer_offline", "copy_prefix", "store_prefix", "close")
HEARTBEAT = "heartbeat"  # sent by an idle rank 0 so that no follower's wait reaches the timeout


class RankGone(RuntimeError):
    """Rank 0 stopped sending (its process ended, or a collective timed out)."""


def _message_device(rows: DeviceRows):
    """Where broadcast_object_list stages a message: the default on the CPU (gloo); nccl and hccl
    send device tensors."""
    return None if rows.device.type == "cpu" else rows.device


class LeaderRows:
    """Rank 0's DeviceRows: each followed call goes to the other ranks first, then runs here."""

    def __init__(self, rows: DeviceRows, heartbeat_seconds: float | None = None, group=None, source: int = 0):
        self._rows = rows
        self._device = _message_device(rows)
        self._group, self._source = group, source  # None, 0: the whole world, its rank 0
        self.heartbeat_seconds = heartbeat_seconds or collective_timeout() / 4
        self._last_sent = time.monotonic()

    def _send(self, name: str, args: tuple) -> None:
        dist.broadcast_object_list([(name, args)], src=self._source, group=self._group, device=self._device)
        self._last_sent = time.monotonic()

    def idle(self) -> None:
        """The engine has nothing to do: keep the followers' wait short of the timeout. Called on
        the engine's thread, between steps, so it never interleaves with a step's collectives."""
        if time.monotonic() - self._last_sent >= self.heartbeat_seconds:
            self._send(HEARTBEAT, ())

    def __getattr__(self, name):
        value = getattr(self._rows, name)
        if name not in FOLLOWED:
            return value

        def followed(*args):
            self._send(name, args)
            return value(*args)

        return followed


def follow(rows: DeviceRows, group=None, source: int = 0) -> None:
    """Another rank: make its leader's calls until it closes (the leader: global rank ``source`` of
    ``group``; by default rank 0 of the world). RankGone if the leader is gone."""
    device = _message_device(rows)
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=source, group=group, device=device)
        except RuntimeError as error:  # gloo: the connection closed; nccl/hccl: the timeout
            raise RankGone(f"rank {source} stopped answering ({str(error).splitlines()[0]})") from None
        name, args = message[0]
        if name == HEARTBEAT:
            continue
        if name not in FOLLOWED:  # never sent by LeaderRows: a different program on the leader
            raise RuntimeError(f"rank {source} sent an unknown call {name!r}")
        try:
            getattr(rows, name)(*args)
        except Exception as error:  # rank 0 met the same error and answered it; stay in step
            print(f"error: {name}: {error}", file=sys.stderr)
        if name == "warm_up":
            freeze_long_lived()  # as rank 0's engine does: a collection's pause would stall a collective
        if name == "close":
            return
