"""The serving process's long-lived heap, kept out of Python's garbage collector once warmed up.

A server's objects at the end of its warm-up (the model's modules and parameters, the tokenizer,
the warm-up's caches: some 300,000 tracked objects for bloom-560m) live as long as the process.
Every so often Python's collector makes a full pass over all tracked objects, holding the
interpreter lock meanwhile; over that heap a pass takes a fifth of a second, and the engine's thread
(between its steps' operations) and the event loop wait for it. Frozen (``gc.freeze``), those
objects are left out of every later pass; what the server allocates while it runs is still
collected as before.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect what is garbage now (so no unreachable cycle is frozen for good), then freeze the rest."""
    gc.collect()
    gc.freeze()
