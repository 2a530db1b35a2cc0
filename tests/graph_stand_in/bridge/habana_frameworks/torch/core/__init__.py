"""``mark_step``: in lazy mode it ends the queued eager ops (one lazy graph, see graph_stand_in/lazy.py)."""

from ... import torch as bridge

COUNTS = {"mark_step": 0}


def mark_step():
    COUNTS["mark_step"] += 1
    bridge.lazy_boundary()
