"""How our kernels prefetch the weights a decode streams from memory (``csrc/prefetch.h``): into
L1 further along the same rows, into L2 the next block of rows, or not at all (the hardware's
stream prefetchers alone). Which keeps the memory busiest depends on the CPU, on the weights'
format (the Xeons streamed at the memory's speed with L1; one Zen 4 at half of it, and at full
speed with L2; a Zen 5 streamed bf16 and fp32 fastest with none, and int4 at half speed with
none) and, for float weights, on how many rows a product multiplies (that Zen 5's bf16 products
of 2 rows or more, and fp32's of 4 or more, streamed fastest with L2). So it is chosen like the
routes (``choice.py``): the three kinds timed once per machine and format on a product over a
weight of that format larger than the caches (for float weights, once per row class of the
kernels: a product of 1, 2, 4 and 8 rows), the fastest cached beside the kernels and set for that
format's products; ``static`` (and the test suite) takes the CPU vendor's rule
(``capability.weight_prefetch``) for every row count; ``$BLOOM_CPU_PREFETCH`` forces one. Every
kind gives the same bits: only the speed depends on it. The weight timed sits in huge pages where
the model's do (``huge_pages.py``): the prefetch that wins can depend on the pages it crosses."""

from __future__ import annotations

import os

import torch

from . import capability, choice
from .huge_pages import huge_zeros
from .kernels import Kernels

# The weight timed: 128 MB of rows STREAM_WIDTH wide, beyond the caches, so a product reads it from
# memory as a decode step reads the model's weights.
STREAM_BYTES = 128 << 20
STREAM_WIDTH = 1024
INT4_GROUP = 64  # the int4 weight's scales: one per 64 weights of a row (the default --group_size)
FLOAT_WEIGHTS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # PREFETCH_FORMATS' keys


def choose_prefetch(kernels: Kernels, option: str | None, parallel, activations: torch.dtype = torch.bfloat16,
                    quantized: str | None = None, huge_pages: bool = False) -> tuple[str, str]:
    """Set the weight prefetch of ``kernels``' products over the model's weights, for the process:
    the kind set for one row ('none', 'l1' or 'l2'), and which and how, for the load line: 'weight
    prefetch l2 (measured)', 'weight prefetch none, l2 from 2 rows (cached)', '(by vendor)',
    '(forced)'.
    ``activations``: the model's dtype (its float weights' too); ``quantized``: 'int8' or 'int4'
    where its weights are; ``option``: the routes' choice mode (``CpuOptions.choice``);
    ``parallel``: the model's ranks, which take rank 0's pick; ``huge_pages``: the model's weights
    are in huge pages (``CpuOptions.huge_pages``)."""
    weights = quantized or FLOAT_WEIGHTS[activations]  # a key of capability.PREFETCH_FORMATS
    classes = row_classes(kernels, weights)
    if os.environ.get(capability.PREFETCH_ENV, "").strip():
        kinds, how = {rows: capability.weight_prefetch() for rows in classes}, "forced"
    else:
        chosen = choice.agree(parallel, lambda: decide(kernels, option, weights, activations, huge_pages))
        kinds = {rows: chosen.picks[f"prefetch:{rows}"] for rows in classes}
        how = chosen.how + (", provisional" if chosen.provisional else "")
        how = "by vendor" if how in ("static", "forced") else how  # another key forced: the vendor's rule
    for rows, kind in kinds.items():  # fewest rows first: each sets its class and those above it
        kernels.set_prefetch(capability.PREFETCH_KINDS[kind], capability.PREFETCH_FORMATS[weights], rows)
    return kinds[1], f"weight prefetch {described(kinds)} ({how})"


def row_classes(kernels: Kernels, weights: str) -> list[int]:
    """The first row count of each class the products over ``weights`` take their own kind for: the
    kernels' classes for float weights, one class for int8 and int4 (``csrc/prefetch.h``)."""
    return list(kernels.prefetch_row_classes()) if weights in FLOAT_WEIGHTS.values() else [1]


def described(kinds: dict[int, str]) -> str:
    """{1: 'none', 2: 'l2', 4: 'l2', 8: 'l2'} -> 'none, l2 from 2 rows': the one-row kind, then each
    row count from which another holds."""
    rows = sorted(kinds)
    changes = [f"{kinds[r]} from {r} rows" for before, r in zip(rows, rows[1:]) if kinds[r] != kinds[before]]
    return ", ".join([kinds[rows[0]], *changes])


def streamed_weight(weights: str, activations: torch.dtype, huge_pages: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight of STREAM_BYTES in the format ``weights`` and its scales (None for float weights,
    which are of the activations' dtype), in huge pages where the model's are: zeros, written, as
    pages never touched would all read one shared page."""
    zeros = huge_zeros if huge_pages else torch.zeros
    if weights == "int8":
        rows = STREAM_BYTES // STREAM_WIDTH
        return zeros((rows, STREAM_WIDTH), dtype=torch.int8), torch.ones(rows)
    if weights == "int4":
        rows = STREAM_BYTES // (STREAM_WIDTH // 2)
        return zeros((rows, STREAM_WIDTH // 2), dtype=torch.uint8), torch.ones(rows, STREAM_WIDTH // INT4_GROUP)
    return zeros((STREAM_BYTES // (STREAM_WIDTH * activations.itemsize), STREAM_WIDTH), dtype=activations), None


def streamed_product(kernels: Kernels, weights: str, activations: torch.dtype, huge_pages: bool):
    """``weights``' few-rows product over a weight of STREAM_BYTES (``streamed_weight``, allocated
    here), as a function of the rows of ``activations`` it multiplies (ones)."""
    w, scales = streamed_weight(weights, activations, huge_pages)
    if weights == "int8":
        product = lambda x: kernels.int8_rows_linear(x, w, scales, None)  # noqa: E731
    elif weights == "int4":
        product = lambda x: kernels.int4_rows_linear(x, w, scales, None)  # noqa: E731
    else:
        product = lambda x: kernels.few_rows_linear(x, w, None)  # noqa: E731
    inputs: dict[int, torch.Tensor] = {}

    def call(rows: int) -> torch.Tensor:
        if rows not in inputs:  # once per row count
            inputs[rows] = torch.ones(rows, STREAM_WIDTH, dtype=activations)
        return product(inputs[rows])
    return call


def decide(kernels: Kernels, option: str | None, weights: str, activations: torch.dtype,
           huge_pages: bool) -> choice.Chosen:
    """The kind of each row class (keys 'prefetch:1', 'prefetch:2', ...: ``row_classes``), timed
    with the class's first row count on one product (made at the first timing only: a cached answer
    allocates nothing)."""
    product = []
    fmt = capability.PREFETCH_FORMATS[weights]

    def streaming(kind: str, rows: int):
        def run() -> float:
            if not product:
                product.append(streamed_product(kernels, weights, activations, huge_pages))
            kernels.set_prefetch(capability.PREFETCH_KINDS[kind], fmt, rows)
            return choice.timed(lambda: product[0](rows))
        return run

    classes = row_classes(kernels, weights)
    candidates = {f"prefetch:{rows}": {kind: streaming(kind, rows) for kind in capability.PREFETCH_KINDS}
                  for rows in classes}
    determined_by = {"what": "weight prefetch", "isa": kernels.isa, "weights": weights,
                     "activations": str(activations), "bytes": STREAM_BYTES, "width": STREAM_WIDTH,
                     "huge_pages": huge_pages}
    vendor = capability.weight_prefetch()
    return choice.choose(candidates, {key: vendor for key in candidates}, determined_by, option)
