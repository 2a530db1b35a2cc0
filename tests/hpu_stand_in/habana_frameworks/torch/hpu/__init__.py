"""``habana_frameworks.torch.hpu``: ``wrap_in_hpu_graph`` only in lazy mode, ``synchronize``."""

from .. import LAZY

COUNTS = {"synchronize": 0}


def synchronize():
    COUNTS["synchronize"] += 1


if LAZY:
    from .graphs import ViewWriteInGraph, wrap_in_hpu_graph  # noqa: F401
