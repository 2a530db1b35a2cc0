#!/usr/bin/env python3
"""The products of one BLOOM block's linears on an NVIDIA card, for a few rows (decode): bf16 weights
(``F.linear``), int8 and int4 weights through the public ops (the weight dequantized per product) and
through our Triton kernels (``bloom_hpu/runtime/cuda_quantized.py``), side by side in one run.

Each variant is captured in one CUDA graph of all four products of a block and replayed; the time
is the median of the replays, with the bytes of weight read per second beside it.

    python bench/cuda_products_bench.py --hidden 4096 --rows 1 4 16     # bloom-7b1's block
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bloom_hpu.int4 import group_scales, int4_product, quantize_groups  # noqa: E402
from bloom_hpu.quantize import int8_product, quantize_rows, row_scales  # noqa: E402
from bloom_hpu.runtime.cuda_quantized import quantized_rows  # noqa: E402


def block_shapes(hidden: int) -> list[tuple[int, int]]:
    """[N, K] of a BLOOM block's weights: fused QKV, attention output, MLP up, MLP down."""
    return [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]


def timed(fn, repeats: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--group_size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    weights = [torch.randn(n, k, device="cuda") * 0.02 for n, k in block_shapes(args.hidden)]
    bf16 = [w.to(dtype) for w in weights]
    int8 = [(quantize_rows(w, s), s) for w in weights for s in [row_scales(w)]]
    int4 = [(quantize_groups(w, s), s) for w in weights for s in [group_scales(w, args.group_size)]]
    bytes_of = {"bf16": sum(w.numel() * 2 for w in bf16),
                "int8": sum(q.numel() + s.numel() * 4 for q, s in int8),
                "int4": sum(q.numel() + s.numel() * 4 for q, s in int4)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one block of hidden {args.hidden}")
    print("| rows | variant | ms | GB/s of weight | x bf16's time | kernel max error vs public ops |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        xs = [torch.randn(rows, k, device="cuda").to(dtype) for _, k in block_shapes(args.hidden)]
        variants = {
            "bf16": ("bf16", lambda: [F.linear(x, w) for x, w in zip(xs, bf16)]),
            "int8 public ops": ("int8", lambda: [int8_product(x, q, s, int8_mm=False) for x, (q, s) in zip(xs, int8)]),
            "int8 kernel": ("int8", lambda: [quantized_rows(x, q, s) for x, (q, s) in zip(xs, int8)]),
            "int4 public ops": ("int4", lambda: [int4_product(x, q, s) for x, (q, s) in zip(xs, int4)]),
            "int4 kernel": ("int4", lambda: [quantized_rows(x, q, s) for x, (q, s) in zip(xs, int4)]),
        }
        errors = {}
        for fmt, pairs in (("int8", int8), ("int4", int4)):
            public = variants[f"{fmt} public ops"][1]()
            kernel = variants[f"{fmt} kernel"][1]()
            errors[fmt] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                              for a, b in zip(kernel, public))
        base = None
        for name, (fmt, fn) in variants.items():
            ms = timed(fn, args.repeats)
            base = base or ms
            error = f"{errors[fmt]:.1e} (relative)" if name.endswith("kernel") else ""
            print(f"| {rows} | {name} | {ms:.4f} | {bytes_of[fmt] / ms / 1e6:.0f} | {ms / base:.2f} | {error} |")


if __name__ == "__main__":
    main()
