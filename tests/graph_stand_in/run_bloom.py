"""``python tests/graph_stand_in/run_bloom.py hpu|cuda [bloom.py arguments]``: ./bloom.py on the graph
stand-in, for tests of the entry points that run as processes (the CLI, the chat shell, deepspeed
ranks). At exit it writes what the stand-in counted to ``$GRAPH_STAND_IN_REPORT`` (JSON), if set."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
sys.path[:0] = [str(ROOT), str(TESTS)]

# The deepspeed launcher puts --local_rank=N first: the personality is the first word that is one.
personality = next(a for a in sys.argv[1:] if a in ("hpu", "cuda"))
sys.argv.remove(personality)
if personality == "hpu":
    sys.path.insert(0, str(TESTS / "graph_stand_in" / "bridge"))

import bloom  # noqa: E402  (sets the HPU environment before torch)
from graph_stand_in import install  # noqa: E402

runtime = install(personality, setattr)


def report() -> None:
    path = os.environ.get("GRAPH_STAND_IN_REPORT")
    if not path:
        return
    rank = os.environ.get("RANK", "0")
    lazy = runtime.lazy
    with open(f"{path}.{rank}", "w") as out:
        json.dump({"captures": runtime.captures, "lazy_compiles": lazy.compiles if lazy else None}, out)


atexit.register(report)
sys.exit(bloom.main())
