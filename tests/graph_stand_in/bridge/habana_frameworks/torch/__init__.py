"""The bridge's root: it reads the environment once, when first imported, as the real one does.

In lazy mode it owns the ``LazyTracker`` (graph_stand_in/lazy.py) that hashes the eager ops
between steps; ``lazy_boundary`` ends the current queue (``mark_step``, a graph, a synchronize)."""

import json
import os

IMPORT_ENVIRONMENT = {k: v for k, v in os.environ.items() if k.startswith(("PT_HPU_", "PT_ENABLE_", "HCL_"))}
LAZY = IMPORT_ENVIRONMENT.get("PT_HPU_LAZY_MODE") == "1"

# A subprocess test names a file here to learn what the bridge saw at import.
if os.environ.get("HPU_STAND_IN_RECORD"):
    with open(os.environ["HPU_STAND_IN_RECORD"], "w") as record:
        json.dump(IMPORT_ENVIRONMENT, record)

LAZY_TRACKER = None
if LAZY:
    from graph_stand_in.lazy import LazyTracker

    LAZY_TRACKER = LazyTracker()
    LAZY_TRACKER.ensure_entered()  # the importing thread; others join at their first step


def lazy_boundary() -> None:
    if LAZY_TRACKER is not None:
        LAZY_TRACKER.ensure_entered()
        LAZY_TRACKER.flush()


from . import core, hpu  # noqa: E402,F401
