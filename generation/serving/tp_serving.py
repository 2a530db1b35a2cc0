"""Serving under tensor parallelism: rank 0 runs the engine and answers HTTP; the other ranks follow.

The engine decides everything on rank 0's host and reaches the model only through ``DeviceRows``
calls made of host values (``device_rows.py``). Rank 0 sends each such call, its name and its
arguments, to every other rank (one ``broadcast_object_list``) before making it itself; each other
rank makes the same call on its own shard. So every rank runs the same steps in the same order,
and the collectives inside the steps pair up. Only rank 0 reads the logits: the tokens it chose
come to the other ranks as the arguments of the next decode.

A call that fails on every rank alike (a bad request's prefill) fails on each and the ranks go on
in step. A failure on one rank alone leaves the others waiting in a collective: the run hangs, as
any tensor-parallel run does when one card fails.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from .device_rows import DeviceRows

# The DeviceRows calls that touch the model or its caches: every rank makes them.
FOLLOWED = ("warm_up", "prefill", "decode", "place", "move", "resize", "answer_offline", "close")


def _message_device(rows: DeviceRows):
    """Where broadcast_object_list stages a message: the default on the CPU (gloo); nccl and hccl
    send device tensors."""
    return None if rows.device.type == "cpu" else rows.device


class LeaderRows:
    """Rank 0's DeviceRows: each followed call goes to the other ranks first, then runs here."""

    def __init__(self, rows: DeviceRows):
        self._rows = rows
        self._device = _message_device(rows)

    def __getattr__(self, name):
        value = getattr(self._rows, name)
        if name not in FOLLOWED:
            return value

        def followed(*args):
            dist.broadcast_object_list([(name, args)], src=0, device=self._device)
            return value(*args)

        return followed


def follow(rows: DeviceRows) -> None:
    """Another rank: make rank 0's calls until it closes."""
    device = _message_device(rows)
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, device=device)
        name, args = message[0]
        if name not in FOLLOWED:  # never sent by LeaderRows: a different program on rank 0
            raise RuntimeError(f"rank 0 sent an unknown call {name!r}")
        try:
            getattr(rows, name)(*args)
        except Exception as error:  # rank 0 met the same error and answered it; stay in step
            print(f"error: {name}: {error}", file=sys.stderr)
        if name == "close":
            return
