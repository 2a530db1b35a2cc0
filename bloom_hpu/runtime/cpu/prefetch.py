"""How our kernels prefetch the weights a decode streams from memory (``csrc/prefetch.h``): into
L1 further along the same rows, or into L2 the next block of rows. Which keeps the memory busier
depends on the CPU (the Xeons streamed at the memory's speed with the first, a Zen 4 at half of it
and at full speed with the second), so it is chosen like the routes (``choice.py``): both kinds
timed once per machine on a product over a weight larger than the caches, the faster cached
beside the kernels; ``static`` (and the test suite) takes the CPU vendor's rule
(``capability.weight_prefetch``); ``$BLOOM_CPU_PREFETCH`` forces one. Both give the same bits: only
the speed depends on it. The weight timed sits in huge pages where the model's do (``huge_pages.py``):
the prefetch that wins can depend on the pages it crosses."""

from __future__ import annotations

import os

import torch

from . import capability, choice
from .huge_pages import huge_zeros
from .kernels import Kernels

# A bf16 weight of [STREAM_ROWS, STREAM_WIDTH]: 128 MB, beyond the caches, so a product reads it
# from memory as a decode step reads the model's weights.
STREAM_ROWS = 65536
STREAM_WIDTH = 1024


def choose_prefetch(kernels: Kernels, option: str | None, parallel, huge_pages: bool = False) -> str:
    """Set the process's weight prefetch for ``kernels`` and say which and how: 'weight prefetch l2
    (measured)', '(cached)', '(static)', '(forced)'. ``option``: the routes' choice mode
    (``CpuOptions.choice``); ``parallel``: the model's ranks, which take rank 0's pick;
    ``huge_pages``: the model's weights are in huge pages (``CpuOptions.huge_pages``)."""
    if os.environ.get(capability.PREFETCH_ENV, "").strip():
        kind, how = capability.weight_prefetch(), "forced"
    else:
        chosen = choice.agree(parallel, lambda: decide(kernels, option, huge_pages))
        kind, how = chosen.picks["prefetch"], chosen.how + (", provisional" if chosen.provisional else "")
        how = "by vendor" if how in ("static", "forced") else how  # another key forced: the vendor's rule
    kernels.set_prefetch(capability.PREFETCH_KINDS[kind])
    return f"weight prefetch {kind} ({how})"


def decide(kernels: Kernels, option: str | None, huge_pages: bool = False) -> choice.Chosen:
    weight = []  # made at the first timing only: a cached answer allocates nothing
    x = torch.ones(1, STREAM_WIDTH, dtype=torch.bfloat16)

    def streaming(kind: str):
        def run() -> float:
            if not weight:  # zeros, written: pages never touched would all read one shared page
                zeros = huge_zeros if huge_pages else torch.zeros
                weight.append(zeros((STREAM_ROWS, STREAM_WIDTH), dtype=torch.bfloat16))
            kernels.set_prefetch(capability.PREFETCH_KINDS[kind])
            return choice.timed(lambda: kernels.few_rows_linear(x, weight[0], None))
        return run

    candidates = {"prefetch": {kind: streaming(kind) for kind in capability.PREFETCH_KINDS}}
    determined_by = {"what": "weight prefetch", "isa": kernels.isa, "weight": [STREAM_ROWS, STREAM_WIDTH],
                     "huge_pages": huge_pages}
    return choice.choose(candidates, {"prefetch": capability.weight_prefetch()}, determined_by, option)
