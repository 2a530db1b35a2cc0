#!/usr/bin/env python3
"""How fast this CPU can run BLOOM's matrix products, and how close our kernel and PyTorch's get.

Measurements, the evidence behind docs/performance.md's "why" paragraphs:

1. **Decode products** (memory-bound at a few rows): one pass over every linear weight of a
   bloom-560m-shaped model (24 blocks + the tied LM head, 1 GB in bf16: far larger than the caches,
   as in a real decode step), with M = 1 ... 128 input rows (``--rows``; a server's mixed step
   carries tens), through ``F.linear``, oneDNN's packed weights where its probe passes, and our
   few-rows kernel (``bloom_hpu/runtime/cpu/kernels.py``) of each build this CPU runs, the
   AVX-512 one also with its AMX tiles where the CPU has them; printed as ms per pass and GB/s read,
   beside the read bandwidth.
2. **Prefill products** (compute-bound): a 128-token prompt through the four linears of a block,
   ``F.linear`` (oneDNN) in GFLOP/s.
3. **Prompts per weight format** (``--prompt``): a ``--prompt_tokens`` prompt's prefill of a
   bloom-560m-shaped random model through the CPU path ``--cpu_path`` chooses, in fp32, bf16, and
   bf16 activations over int8 and int4 (G=32) weights (``--widen_off``: each also with
   ``CpuOptions(widen=False)``: where this CPU's bf16 products are emulated, the products of many
   rows through PyTorch's emulated bf16 instead of fp32 on the widened weight); ms and the ratio to
   fp32, one run. Run it
   as an AVX2 CPU with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ... --cpu_path avx2``.
4. **Integer products** (``--integer``): ``block_q8_linear`` (the input rounded to int8 per block
   of 32, ``bloom_hpu/int8_activations.py``) over int8 and int4 (G=64) weights, on the four product
   shapes of a bloom-560m block at M = 1, 16, 128 rows (``--integer_rows``), beside fp32
   ``F.linear``, bf16 ``F.linear`` on the widened weight (oneDNN's product), and the weight-only
   int8/int4 kernels (bf16 input), and on a CPU with AMX the int8 one again with the AMX-INT8 tiles
   on (``q8 int8 tiles``); ms and each one's speed-up over fp32, for each kernel build this
   process runs (as an AVX2 CPU: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``, which also
   caps PyTorch's own products).
5. **fp32 against bf16** (``--dtypes``): our few-rows kernel over a block's four weights in each,
   at M = 1 ... 16 rows (``--dtype_rows``), per kernel build this process runs.
6. **The bf16 dot-product peak**: VDPBF16PS on registers only, no memory, on every thread (built
   with ``torch.utils.cpp_extension``, a few seconds), in GFLOP/s; and where the CPU has AMX, the
   same for TDPBF16PS on tiles loaded once. Our kernels cannot beat them.

    OMP_NUM_THREADS=2 python bench/cpu_products_bench.py --threads 2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=2 python bench/cpu_products_bench.py \
        --threads 2 --prompt --cpu_path avx2 --skip_products
    OMP_NUM_THREADS=2 python bench/cpu_products_bench.py --threads 2 --integer --skip_products
    OMP_NUM_THREADS=2 python bench/cpu_products_bench.py --threads 2 --dtypes --skip_products
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generate_bench import read_bandwidth  # noqa: E402
from bloom_hpu.runtime.cpu import capability  # noqa: E402
from bloom_hpu.runtime.cpu.kernels import KernelsUnavailable, load  # noqa: E402
from bloom_hpu.runtime.cpu.layers import AMX_MIN_ROWS  # noqa: E402

HIDDEN, LAYERS, VOCAB = 1024, 24, 250880  # bloom-560m

PEAK_SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    #include <ATen/Parallel.h>
    #include <immintrin.h>
    // 16 independent VDPBF16PS chains per thread (enough to hide the latency), registers only.
    double dot_peak(int64_t iterations) {
      std::atomic<int64_t> threads{0};
      at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          threads++;
          __m512 acc[16];
          for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(i);
          __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f003f00);
          for (int64_t it = 0; it < iterations; ++it) {
    #pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
            asm volatile("" : "+v"(a));
          }
          volatile float sink = 0;  // keeps the sums, so the loop is not optimised away
          for (int i = 0; i < 16; ++i) sink = sink + _mm512_reduce_add_ps(acc[i]);
        }
      });
      return double(threads.load());  // threads that ran
    }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dot_peak", &dot_peak); }
""")


AMX_PEAK_SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    #include <ATen/Parallel.h>
    #include <immintrin.h>
    #include <sys/syscall.h>
    #include <unistd.h>
    // A constant, as in csrc/amx_rows.h: a stack copy's stores may be dropped (see there).
    struct alignas(64) Config { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
    constexpr Config kConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
    // Four independent TDPBF16PS chains per thread on tiles loaded once: no memory. -1: no tiles here.
    double tile_peak(int64_t iterations) {
      if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;
      std::atomic<int64_t> threads{0};
      at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
        alignas(64) static thread_local uint16_t operand[16 * 32];
        alignas(64) float sink[16 * 16];
        for (int64_t t = begin; t < end; ++t) {
          threads++;
          _tile_loadconfig(&kConfig);
          for (int i = 0; i < 16 * 32; ++i) operand[i] = 0x3f80;
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          _tile_loadd(4, operand, 64); _tile_loadd(5, operand, 64); _tile_loadd(6, operand, 64); _tile_loadd(7, operand, 64);
          for (int64_t it = 0; it < iterations; ++it) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, sink, 64);
          _tile_release();
        }
      });
      return double(threads.load());
    }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tile_peak", &tile_peak); }
""")


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_weights() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every linear weight (and bias) of a bloom-560m-shaped model in bf16, the LM head last."""
    made = []
    for _ in range(LAYERS):
        for out_f, in_f in ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN)):
            made.append((torch.randn(out_f, in_f).bfloat16(), torch.randn(out_f).bfloat16()))
    made.append((torch.randn(VOCAB, HIDDEN).bfloat16(), None))
    return made


def decode_products(repeats: int, row_counts: list[int]) -> None:
    cap = capability.detect()
    paths = {"F.linear": (lambda x, w, b: F.linear(x, w, b), None)}
    weights = decode_weights()
    if capability.onednn_packs(torch.bfloat16):
        ops = torch.ops.mkldnn
        packed = {id(w): ops._reorder_linear_weight(w, 16) for w, _ in weights}
        paths["oneDNN packed"] = (lambda x, w, b: ops._linear_pointwise(x, packed[id(w)], b, "none", [], ""), None)
    for isa in ("avx512_bf16", "avx2"):
        if not cap.can_run(isa):
            print(f"(no {isa} kernels: {cap.why})")
            continue
        try:
            kernels = load(isa)
        except KernelsUnavailable as error:
            print(f"(no {isa} kernels: {error})")
            continue
        paths[f"{isa} kernel"] = (kernels.few_rows_linear, (kernels, 0))
        if cap.amx and kernels.enable_amx(4):
            paths[f"{isa} kernel, AMX"] = (kernels.few_rows_linear, (kernels, 4))
        kernels.enable_amx(0)
    total = sum(w.nbytes for w, _ in weights)
    print(f"decode products: one pass over {total / 1e9:.2f} GB of bf16 weights (ms, GB/s)")
    print("rows  " + "".join(f"{name:>24s}" for name in paths))
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in (HIDDEN, 4 * HIDDEN)}
        cells = []
        for product, amx in paths.values():
            if amx is not None:  # the kernels' AMX setting, for the process
                amx[0].enable_amx(amx[1])
            ms = median_ms(lambda: [product(inputs[w.shape[1]], w, b) for w, b in weights], repeats)
            cells.append(f"{ms:15.1f}  {total / ms / 1e6:5.1f}")
        print(f"{rows:4d}  " + "  ".join(cells))


def prefill_products(repeats: int, tokens: int = 128) -> None:
    flop = 0
    shapes = ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN))
    weights = [(torch.randn(o, i).bfloat16(), torch.randn(o).bfloat16()) for o, i in shapes]
    inputs = {k: torch.randn(tokens, k).bfloat16() for k in (HIDDEN, 4 * HIDDEN)}
    flop = sum(2 * tokens * w.numel() for w, _ in weights)
    ms = median_ms(lambda: [F.linear(inputs[w.shape[1]], w, b) for w, b in weights], repeats)
    print(f"prefill products: {tokens} tokens x one block's 4 linears, F.linear: {ms:.2f} ms, "
          f"{flop / ms / 1e6:.1f} GFLOP/s")


PROMPT_FORMATS = (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                  ("int8", torch.bfloat16, "int8"), ("int4 G=32", torch.bfloat16, "int4"))


def prompt_times(repeats: int, tokens: int, path: str, widen_off: bool) -> None:
    """One ``tokens`` prompt's prefill per weight format (``widen_off``: each also without the
    widened products). The timed runs go round-robin over the variants (as generate_bench's), so a
    drift in the machine's load hits them alike; where a model runs two variants, its plan is
    applied again right before each run, and one untimed prefill then fills its scratch memory."""
    from bloom_hpu.config import BloomConfig
    from bloom_hpu.model import StaticBloom
    from bloom_hpu.quantize import quantize
    from bloom_hpu.runtime.cpu import CpuOptions, accelerate
    from utils.random_checkpoint import random_weights

    config = BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=16)
    fp32 = StaticBloom(config)
    fp32.load_state_dict(random_weights(config, live_vocab=VOCAB, seed=0, weight_scale=1.0))
    fp32 = fp32.eval().requires_grad_(False)
    models = {"fp32": fp32}
    for label, dtype, mode in PROMPT_FORMATS[1:]:
        model = StaticBloom(config).to(dtype).eval().requires_grad_(False)
        model.load_state_dict(fp32.state_dict())
        models[label] = quantize(model, mode, 32 if mode == "int4" else None) if mode else model
    variants = [(label, widen) for label in models for widen in (True, False)
                if widen or (widen_off and label != "fp32")]
    ids = torch.randint(4, min(50000, VOCAB), (1, tokens), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([tokens])
    caches = {label: model.allocate_cache(1, tokens + 8) for label, model in models.items()}
    times, widened = {v: [] for v in variants}, {}
    with torch.no_grad():
        for r in range(repeats + 1):  # round 0: untimed
            for label, widen in variants[r % len(variants):] + variants[:r % len(variants)]:
                model = models[label]
                if r == 0 or widen_off:
                    plan = accelerate(model, CpuOptions(path=path, widen=widen))
                    widened[label, widen] = "weights widened" in plan.description
                    model.prefill(ids, lengths, caches[label])
                start = time.perf_counter()
                model.prefill(ids, lengths, caches[label])
                if r:
                    times[label, widen].append(time.perf_counter() - start)
    print(f"prompt of {tokens} tokens, bloom-560m shape, --cpu_path {path} ({capability.detect().why}), "
          f"median of {repeats}: ms (x fp32's)")
    fp32_ms = statistics.median(times["fp32", True]) * 1e3
    for label in models:
        cells = []
        for widen in ((True, False) if (label, False) in times else (True,)):
            ms = statistics.median(times[label, widen]) * 1e3
            how = "widened" if widened[label, widen] else "widen off" if label != "fp32" else ""
            cells.append(f"{how:>10s} {ms:8.1f} ({ms / fp32_ms:4.2f}x)")
        print(f"{label:>10s}  " + "   ".join(cells))


BLOCK_SHAPES = ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN))  # [N, K]


def with_tiles(kernels, product, x, q, scales):
    """``product(x, q, scales, None)`` with the kernels' AMX tiles on, then off again."""
    kernels.enable_amx(AMX_MIN_ROWS)
    try:
        return product(x, q, scales, None)
    finally:
        kernels.enable_amx(0)


def kernel_builds(cap) -> dict:
    """{isa: our kernels} for each build this CPU runs (a build that fails is named and left out)."""
    builds = {}
    for isa in ("avx512_bf16", "avx2"):
        if not cap.can_run(isa):
            continue
        try:
            builds[isa] = load(isa)
        except KernelsUnavailable as error:
            print(f"(no {isa} kernels: {error})")
    return builds


def round_robin_ms(calls: dict, repeats: int) -> dict:
    """{name: median ms} of ``repeats`` timed calls of each, after one untimed call each; the
    calls go round-robin, so a drift in the machine's load hits them alike."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def integer_products(repeats: int, row_counts: list[int]) -> None:
    """block_q8_linear against fp32 and bf16 F.linear and the weight-only kernels, per shape and M.
    Each cell's calls go round-robin with the others' (as prompt_times'), so a drift in the
    machine's load hits them alike; the median per cell."""
    from bloom_hpu.int4 import group_scales, quantize_groups

    cap = capability.detect()
    builds = kernel_builds(cap)
    if not builds:
        print(f"integer products: no kernel build runs here ({cap.why})")
        return
    # The AVX-512 build's AMX tiles, where this CPU and process can have them; off for every other
    # path (the library's switch is per process).
    tiles = {isa: isa == "avx512_bf16" and cap.amx and kernels.enable_amx(AMX_MIN_ROWS) > 0
             for isa, kernels in builds.items()}
    for kernels in builds.values():
        kernels.enable_amx(0)
    g = torch.Generator().manual_seed(0)
    print(f"integer products ({cap.why}; torch dispatch {torch.backends.cpu.get_cpu_capability()}), "
          f"median of {repeats}: ms (x fp32 F.linear's speed)")
    for isa, kernels in builds.items():
        for n, k in BLOCK_SHAPES:
            w = torch.randn(n, k, generator=g) / k ** 0.5
            scales8 = w.abs().amax(dim=1) / 127
            q8 = torch.round(w / scales8[:, None]).to(torch.int8)
            scales4 = group_scales(w, 64)
            q4 = quantize_groups(w, scales4)
            w16 = w.bfloat16()
            for rows in row_counts:
                x = torch.randn(rows, k, generator=g)
                x16 = x.bfloat16()
                paths = {
                    "fp32": lambda: F.linear(x, w),
                    "bf16": lambda: F.linear(x16, w16),
                    "int8 rows": lambda: kernels.int8_rows_linear(x16, q8, scales8, None),
                    "int4 rows": lambda: kernels.int4_rows_linear(x16, q4, scales4, None),
                    "q8 int8": lambda: kernels.block_q8_linear(x16, q8, scales8, None),
                    "q8 int4": lambda: kernels.block_q8_linear(x16, q4, scales4, None),
                }
                if tiles.get(isa):  # the same call with the AMX tiles on (int8 weights, 5 rows or more)
                    paths["q8 int8 tiles"] = lambda: with_tiles(kernels, kernels.block_q8_linear, x16, q8, scales8)
                ms = round_robin_ms(paths, repeats)
                cells = "".join(f"  {name} {value:7.3f} ({ms['fp32'] / value:5.2f}x)" for name, value in ms.items())
                print(f"{isa:>11s} N={n:4d} K={k:4d} M={rows:3d}:{cells}")


def build_probe(name: str, source: str, cflags: list[str]):
    """``source`` (a peak probe above) built with ``torch.utils.cpp_extension`` in a fresh folder."""
    from torch.utils import cpp_extension

    folder = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    (folder / f"{name}.cpp").write_text(source)
    return cpp_extension.load(name, [str(folder / f"{name}.cpp")], extra_cflags=["-O3", "-fopenmp", *cflags],
                              verbose=False)


def print_peak(label: str, probe, instruction: str, iterations: int, per_iteration: int, flop: int) -> None:
    """Time ``probe(iterations)`` (it returns the threads that ran, each ``per_iteration``
    instructions an iteration, of ``flop`` FLOP each) and print the rate."""
    start = time.perf_counter()
    threads = probe(iterations)
    seconds = time.perf_counter() - start
    instructions = iterations * per_iteration * threads
    print(f"{label}: {instructions / seconds / 1e9:.3f} G {instruction}/s on {int(threads)} threads = "
          f"{instructions * flop / seconds / 1e9:.1f} GFLOP/s")


def dot_peak() -> None:
    if capability.detect().isa != "avx512_bf16":
        print("bf16 dot-product peak: this CPU has no AVX512-BF16")
        return
    module = build_probe("bloom_dot_peak", PEAK_SOURCE, ["-mavx512f", "-mavx512bf16"])
    module.dot_peak(1000)
    # One VDPBF16PS on 512 bits: 16 lanes x 2 products x (multiply + add) = 64 FLOP.
    print_peak("bf16 dot-product peak", module.dot_peak, "VDPBF16PS", 20_000_000, 16, 64)


def tile_peak() -> None:
    """TDPBF16PS on tiles loaded once: the ceiling of the AMX tiles' products (csrc/amx_rows.h)."""
    if not capability.detect().amx:
        print("AMX tile peak: this CPU has no AMX")
        return
    try:
        module = build_probe("bloom_tile_peak", AMX_PEAK_SOURCE, ["-mamx-tile", "-mamx-bf16"])
    except Exception as error:  # a compiler without AMX intrinsics
        print(f"AMX tile peak: could not be built ({type(error).__name__})")
        return
    if module.tile_peak(1000) < 0:
        print("AMX tile peak: Linux did not grant this process the tile state")
        return
    # One TDPBF16PS: 16 x 16 results of 32 products each = 8192 products, 16384 FLOP.
    print_peak("AMX tile peak", module.tile_peak, "TDPBF16PS", 2_000_000, 4, 16384)


def few_rows_dtypes(repeats: int, row_counts: list[int]) -> None:
    """Our few-rows kernel (``few_rows_linear``) in fp32 and in bf16 over a bloom-560m block's
    four weights, per kernel build this CPU runs and per M: whether bf16 is ever slower than fp32.
    The two go round-robin, as in ``integer_products``; medians."""
    cap = capability.detect()
    g = torch.Generator().manual_seed(0)
    weights32 = [torch.randn(n, k, generator=g) / k ** 0.5 for n, k in BLOCK_SHAPES]
    weights16 = [w.bfloat16() for w in weights32]
    print(f"few-rows products, fp32 and bf16 ({cap.why}), median of {repeats}: ms over the four weights")
    for isa, kernels in kernel_builds(cap).items():
        for rows in row_counts:
            inputs32 = [torch.randn(rows, k, generator=g) for _, k in BLOCK_SHAPES]
            runs = {dtype: (lambda xs=xs, ws=ws: [kernels.few_rows_linear(x, w, None) for x, w in zip(xs, ws)])
                    for dtype, xs, ws in (("fp32", inputs32, weights32),
                                          ("bf16", [x.bfloat16() for x in inputs32], weights16))}
            ms = round_robin_ms(runs, repeats)
            fp32, bf16 = ms["fp32"], ms["bf16"]
            print(f"{isa:>11s} M={rows:3d}: fp32 {fp32:7.3f}  bf16 {bf16:7.3f}  bf16 / fp32 {bf16 / fp32:5.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,4,8,16", help="input rows of the decode products, e.g. 1,4,16,32,80,128")
    parser.add_argument("--prompt", action="store_true", help="also time a prompt's prefill per weight format")
    parser.add_argument("--prompt_tokens", type=int, default=128)
    parser.add_argument("--widen_off", action="store_true", help="the prompts also without the widened products")
    parser.add_argument("--cpu_path", default="auto", help="the prompts' CPU path (auto, avx512_bf16, avx2, onednn, plain)")
    parser.add_argument("--skip_products", action="store_true", help="only the prompts (with --prompt) or the integer products")
    parser.add_argument("--integer", action="store_true", help="also time the integer products (block_q8_linear)")
    parser.add_argument("--integer_rows", default="1,16,128", help="input rows of the integer products")
    parser.add_argument("--dtypes", action="store_true", help="also time the few-rows kernel in fp32 against bf16")
    parser.add_argument("--dtype_rows", default="1,2,3,4,5,6,8,12,16", help="input rows of --dtypes")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads; read bandwidth {read_bandwidth(torch.device('cpu')) / 1e9:.1f} GB/s")
    if not args.skip_products:
        decode_products(args.repeats, [int(r) for r in args.rows.split(",")])
        prefill_products(args.repeats)
    if args.prompt:
        prompt_times(args.repeats, args.prompt_tokens, args.cpu_path, args.widen_off)
    if args.integer:
        integer_products(args.repeats, [int(r) for r in args.integer_rows.split(",")])
    if args.dtypes:
        few_rows_dtypes(args.repeats, [int(r) for r in args.dtype_rows.split(",")])
    if not args.skip_products:
        dot_peak()
        tile_peak()
    return 0


if __name__ == "__main__":
    sys.exit(main())
