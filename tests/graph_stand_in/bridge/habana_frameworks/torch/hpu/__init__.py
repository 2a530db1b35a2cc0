"""``habana_frameworks.torch.hpu``: ``wrap_in_hpu_graph`` only in lazy mode, ``synchronize``,
``memory_stats``."""

from .. import LAZY, lazy_boundary

COUNTS = {"synchronize": 0}
# What memory_stats() reports (tests may set it to make the memory check bite).
MEMORY = {"Limit": 32 << 30, "InUse": 0}


def synchronize():
    COUNTS["synchronize"] += 1
    lazy_boundary()


def memory_stats():
    return dict(MEMORY)


if LAZY:
    from .graphs import ViewWriteInGraph, wrap_in_hpu_graph  # noqa: F401
