"""The graph stand-in: our card, with no Gaudi and no GPU (see README.md).

``install(personality, patch)`` makes every ``make_backend("hpu" | "cuda")`` in this process build
the real ``HpuBackend`` or ``CudaBackend`` with its tensors on the CPU, over a runtime that records
and replays graphs (``recording.py``), refuses what a capture cannot hold, and, on the HPU, hashes
lazy mode's eager ops (``lazy.py``). Tests call it through the ``graph_stand_in`` fixture;
``run_bloom.py`` calls it before ``bloom.main`` for the entry points that run as processes (the CLI,
the chat shell, deepspeed ranks).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

BRIDGE = Path(__file__).resolve().parent / "bridge"
PERSONALITIES = ("hpu", "cuda")
# Not a stand-in: the real CUDA card, where the machine has one. The same tests then run the real
# CudaBackend on real CUDA graphs; nothing is patched but a count of the graphs it captures.
REAL_CARD = "gpu"


def install(personality: str, patch, cuda_index: int = 0):
    """Returns a ``Runtime`` view of what the stand-in counted."""
    import torch

    from bloom_hpu.runtime import backends, launch
    import generation.generator as generator_module

    if personality == REAL_CARD:
        return _count_real_captures(patch)
    if personality not in PERSONALITIES:
        raise ValueError(personality)
    if personality == "cuda":
        from . import cuda

        cuda.install(patch)
        cuda.STATE.current_device = cuda_index
    else:
        if str(BRIDGE) not in sys.path:
            sys.path.insert(0, str(BRIDGE))
    original = backends.make_backend

    def make_backend(device=None, use_graphs=True, compile_steps=False, cpu=backends.CpuOptions(), **more):
        device = device or personality
        if device.split(":")[0] == "cpu":
            return original(device, use_graphs, compile_steps, cpu, **more)
        backend = original(device, use_graphs, compile_steps, cpu, **more)
        backend.device = torch.device("cpu")  # the card's memory is the host's here
        return backend

    patch(backends, "make_backend", make_backend)
    patch(generator_module, "make_backend", make_backend)
    # Collectives: gloo on CPU tensors, whatever the card's own library would be.
    patch(launch, "COLLECTIVE_BACKENDS", {kind: "gloo" for kind in launch.COLLECTIVE_BACKENDS})
    patch(launch, "collective_device", lambda kind, index: "cpu")
    return Runtime(personality)


def _count_real_captures(patch):
    """The real card: every backend ``make_backend`` builds is kept, to sum the graphs they capture."""
    import torch

    from bloom_hpu.runtime import backends
    import generation.generator as generator_module

    if not torch.cuda.is_available():
        raise RuntimeError("the real-card personality needs a CUDA device")
    original = backends.make_backend
    runtime = Runtime(REAL_CARD)

    def make_backend(*args, **kwargs):
        backend = original(*args, **kwargs)
        runtime.real_backends.append(backend)
        return backend

    patch(backends, "make_backend", make_backend)
    patch(generator_module, "make_backend", make_backend)
    return runtime


class Runtime:
    """What the stand-in counted in this process, for each personality."""

    def __init__(self, personality: str):
        self.personality = personality
        # The device the tests ask for: the real card is a 'cuda' device like the CUDA stand-in.
        self.device = "cuda" if personality == REAL_CARD else personality
        self.real_backends = []  # REAL_CARD: the backends built, whose captures are counted

    def graph_caches(self):
        if self.personality != "hpu":
            return []
        from habana_frameworks.torch.hpu.graphs import GRAPH_CACHES

        return GRAPH_CACHES

    @property
    def captures(self) -> int:
        if self.personality == "hpu":
            return sum(c.captures for c in self.graph_caches())
        if self.personality == REAL_CARD:
            return sum(getattr(b, "captured", 0) for b in self.real_backends)
        from . import cuda

        return len(cuda.STATE.graphs)

    @property
    def lazy(self):
        """The HPU lazy-mode tracker (None for CUDA)."""
        if self.personality != "hpu":
            return None
        import habana_frameworks.torch as bridge

        return bridge.LAZY_TRACKER

    @contextlib.contextmanager
    def off_card(self):
        """Ops inside are the host's (a reference run on the CPU generator): not lazy-mode ops."""
        lazy = self.lazy
        if lazy is None:
            yield
            return
        lazy.active = False
        try:
            yield
        finally:
            lazy.active = True

    def close(self) -> None:
        if self.lazy is not None:
            self.lazy.close()
