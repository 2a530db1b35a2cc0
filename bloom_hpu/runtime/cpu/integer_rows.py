"""How many input rows the integer products (``csrc/block_q8.h``) multiply with the weight read in
place before they go through the panel, per weight format (int8, int4).

The few-rows path multiplies each weight vector into every input row as it loads it, 4 rows a
pass over each block of weight rows (a second pass finds the block in L1); the panel repacks a
tile of weight rows once and reuses it for every row. At 4 rows or fewer the few-rows path wins
everywhere; at 5-8 (the AVX-512 build) it depends on the CPU and on the weight prefetch in force
(``prefetch.py``): on a Zen 5 the panel was 1.3x slower at 7 rows of int4, and at 8 rows of int8
1.75x faster with the L1 prefetch, level with the L2 one. So it is chosen like the routes
(``choice.py``): each row count timed both ways once per machine and format, on a product over a
weight larger than the caches, the prefetch chosen; the few-rows path keeps the counts up to the
one that makes the least time summed over 5-8 rows (one count timed slow by other work does not
end it early). ``static`` (and the test suite) keeps the build's default; on the AVX2 build the
few-rows path takes 4 rows, nothing to choose.
A row's bits depend on the path (both within the integer products' contract); a batch's rows are
computed alike whatever their number up to the chosen count."""

from __future__ import annotations

import torch

from . import capability, choice, prefetch
from .kernels import Kernels

def bounds(kernels: Kernels) -> tuple[int, int, int]:
    """``kernels``' few-rows path (``csrc/block_q8.h``): the rows it takes in one pass (always its
    own), its build's default limit and the most it can take (8 and 4 on the AVX-512 build, where
    the counts between are chosen; 4 throughout on AVX2)."""
    one_pass, default, most = kernels.q8_few_rows_bounds()
    return one_pass, default, most


def rows_in_place(chosen: choice.Chosen, one_pass: int) -> int:
    """The most rows the few-rows path takes, given the choice over each count past ``one_pass``
    (keys 'rows:5' ... 'rows:8'): the limit whose times, the counts up to it in place and the rest
    through the panel, add up to the least; without times (a static or forced choice), every count
    up to the first the panel was picked for."""
    counts = sorted(int(key.partition(":")[2]) for key in chosen.picks)
    if all(f"rows:{m}" in chosen.times for m in counts):
        def total(limit: int) -> float:
            return sum(chosen.times[f"rows:{m}"]["in place" if m <= limit else "panel"] for m in counts)
        return min((one_pass, *counts), key=total)
    rows = one_pass
    for m in counts:
        if chosen.picks[f"rows:{m}"] != "in place":
            break
        rows = m
    return rows


def choose_integer_rows(kernels: Kernels, option: str | None, parallel, quantized: str,
                        activations: torch.dtype, huge_pages: bool, prefetch_kind: str) -> str | None:
    """Set how many rows ``kernels``' integer products over ``quantized`` ('int8' or 'int4')
    weights multiply in place, for the process, and say it for the load line ('integer products
    in place up to 7 rows (measured)'); None where the build has nothing to choose (AVX2). Run
    after the weight prefetch is set: the timing depends on it, and ``prefetch_kind``, the kind
    ``prefetch.choose_prefetch`` set for the format, is part of the cached answer's name.
    ``option``, ``parallel`` and ``huge_pages`` as for ``prefetch.choose_prefetch``."""
    one_pass, _, most = bounds(kernels)
    if most == one_pass:
        return None
    fmt = capability.PREFETCH_FORMATS[quantized]
    chosen = choice.agree(parallel, lambda: decide(kernels, option, quantized, activations, huge_pages, prefetch_kind))
    rows = rows_in_place(chosen, one_pass)
    how = chosen.how + (", provisional" if chosen.provisional else "")
    how = "by default" if how in ("static", "forced") else how  # another key forced: the default
    kernels.set_q8_few_rows(rows, fmt)
    return f"integer products in place up to {rows} rows ({how})"


def restore_default(kernels: Kernels) -> None:
    """The build's own counts for both formats again."""
    _, default, _ = bounds(kernels)
    for quantized in ("int8", "int4"):
        kernels.set_q8_few_rows(default, capability.PREFETCH_FORMATS[quantized])


def decide(kernels: Kernels, option: str | None, quantized: str, activations: torch.dtype,
           huge_pages: bool, prefetch_kind: str) -> choice.Chosen:
    weight = []  # made at the first timing only: a cached answer allocates nothing
    fmt = capability.PREFETCH_FORMATS[quantized]
    one_pass, default, most = bounds(kernels)
    counts = range(one_pass + 1, most + 1)  # the counts chosen between the two paths

    def product(m: int, in_place: bool):
        def run() -> float:
            if not weight:
                weight.extend(prefetch.streamed_weight(quantized, activations, huge_pages))
            x = torch.randn(m, prefetch.STREAM_WIDTH, generator=torch.Generator().manual_seed(m)).to(activations)
            kernels.set_q8_few_rows(most if in_place else m - 1, fmt)
            return choice.timed(lambda: kernels.block_q8_linear(x, weight[0], weight[1], None))
        return run

    candidates = {f"rows:{m}": {"in place": product(m, True), "panel": product(m, False)} for m in counts}
    static = {f"rows:{m}": "in place" if m <= default else "panel" for m in counts}
    determined_by = {"what": "integer rows in place", "isa": kernels.isa, "weights": quantized,
                     "activations": str(activations), "bytes": prefetch.STREAM_BYTES,
                     "width": prefetch.STREAM_WIDTH, "huge_pages": huge_pages,
                     "prefetch": prefetch_kind}
    return choice.choose(candidates, static, determined_by, option)
