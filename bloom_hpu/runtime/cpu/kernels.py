"""Our CPU kernels (``csrc/``), built once per instruction set and loaded as PyTorch operators.

The operators, the same sources compiled for each ISA into its own library and namespace
(``torch.ops.bloom_avx512.*``, ``torch.ops.bloom_avx2.*``), so both can live in one process:

* ``few_rows_linear(x [..., K], w [N, K], bias)``: products of a few rows with a large weight, at
  the speed at which the weight streams from memory (every decode product, the prefill's LM head);
  in the AVX-512 build, once ``enable_amx(min_rows)`` turned them on, bf16 products of that many
  rows or more run on AMX tiles (``csrc/amx_rows.h``), still reading the weight in place;
* ``decode_step(...)``: a whole decode step in one call (``csrc/decode_step.cpp``), or with ``rows``
  and ``keep`` the server's mixed step (a decode carrying prompt segments);
* ``prompt_attention(...)``: a prefill's attention in one call (``csrc/prompt_attention.cpp``),
  and ``extend_attention(...)`` an extend's (prompts continued after a prefix cache's hit);
* ``int8_rows_linear`` / ``int4_rows_linear``: products of a few rows with a quantized weight
  (``bloom_hpu/quantize.py``), and ``int4_dequantize``, an int4 weight as floats for many rows;
  ``decode_step_quantized``: the decode step over quantized weights;
* ``block_q8_quantize(x)`` and ``block_q8_linear(x, q, scales, bias)``: the integer products
  (``bloom_hpu/int8_activations.py``): x rounded to int8 per block of 32 values, multiplied by an
  int8 or int4 weight with integer dot products (``csrc/block_q8.h``; int8 weights and more than 4
  rows on AMX-INT8 tiles once ``enable_amx`` turned the tiles on, ``csrc/block_q8_amx.h``);
* ``gelu_tanh(x)``: the MLP's GELU with the decode step's formula, split over the threads (the
  prefill's, where no product fuses it);
* ``counter_uniform(base [R], n)``: the uniform noise of sampled search
  (``generation/search/sampling.py``), bit for bit, in one pass instead of some forty.

The products and steps take bf16, fp16 or fp32. A build is compiled on first use with
``torch.utils.cpp_extension`` (g++ and ninja, about a minute on 2 cores, once) into a folder named
by a hash of its sources, flags and torch build, so that a killed build never hangs a later run
(``build.py``), and checked by one probe call against ``F.linear`` before anything uses it.
``load(isa)`` raises ``KernelsUnavailable`` with the reason when it cannot be had; callers then
keep PyTorch's operations.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ...int4 import dequantized_int4
from ...int8_activations import block_product, quantize_blocks
from .build import BuildError, Recipe, load_library
from .capability import ISA_NAMES, PREFETCH_FORMATS, PREFETCH_KINDS, weight_prefetch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("few_rows_linear.cpp", "decode_step.cpp", "prompt_attention.cpp",
                                    "quantized_linear.cpp", "sampling_noise.cpp")]
FLAGS = {
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c",
                    "-DBLOOM_ISA_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DBLOOM_ISA_AVX2"],
}
# The AVX-512 build also holds the AMX products (csrc/amx_rows.h: bf16; csrc/block_q8_amx.h: the
# integer products, where CPUID also shows AMX-INT8), used only once enabled on a CPU with AMX-BF16;
# a compiler without AMX's intrinsics (GCC < 11) builds it without.
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-mamx-int8", "-DBLOOM_AMX"]
NAMESPACE = {"avx512_bf16": "bloom_avx512", "avx2": "bloom_avx2"}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BUILD_TIME = "about a minute"  # g++ -O3 of csrc/ on 2 cores: what a first run says it will wait


class KernelsUnavailable(Exception):
    """The kernels cannot be had here (the message says why, in a few words)."""


@dataclass(frozen=True)
class Kernels:
    """The operators of one build."""

    isa: str
    few_rows_linear: Callable
    decode_step: Callable
    prompt_attention: Callable
    extend_attention: Callable  # (qkv, starts, keys, values, alibi, last): an extend's attention
    int8_rows_linear: Callable  # (x [..., K], q int8 [N, K], scales fp32 [N], bias): weight-only int8
    int4_rows_linear: Callable  # (x [..., K], q uint8 [N, K / 2], scales fp32 [N, K / G], bias): int4
    int4_dequantize: Callable  # (q, scales, out [N, K]): the weight in out's dtype
    decode_step_quantized: Callable  # decode_step over int8 or int4 weights and their scales
    enable_amx: Callable  # (min_rows) -> the limit in force: bf16 products of that many rows on AMX (0: off)
    counter_uniform: Callable  # (base int64 [R], n) -> [R, n] float32: sampling.py's uniform noise
    block_q8_quantize: Callable  # (x [..., K]) -> (xq int8 [..., K], d fp32 [..., K / 32]): quantize_blocks
    block_q8_linear: Callable  # (x, q int8 [N, K] or uint8 [N, K / 2], scales, bias): block_product
    gelu_tanh: Callable  # (x) -> F.gelu(x, approximate="tanh"), the decode step's formula, threaded
    set_prefetch: Callable  # (kind, format, from_rows=1) -> the kind in force: how the few-rows products over
    # one weight format (capability.PREFETCH_FORMATS) of from_rows input rows or more prefetch weights
    # (capability.PREFETCH_KINDS: 0 none, 1 L1, 2 L2)
    prefetch_in_force: Callable  # (format, rows) -> the kind the products of that many rows read
    prefetch_row_classes: Callable  # () -> the first row count of each class set_prefetch tells apart
    set_q8_few_rows: Callable  # (rows, format 1 int8 / 2 int4) -> the rows in force: the most input rows
    # block_q8_linear multiplies with the weight read in place, more through its panel (integer_rows.py)
    q8_few_rows_bounds: Callable  # () -> [rows of one pass, the default, the most] set_q8_few_rows takes


_built: dict[str, Kernels | KernelsUnavailable] = {}


def compiler_found() -> bool:
    """The compiler torch.utils.cpp_extension will call ($CXX, else c++) is on the PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def load(isa: str) -> Kernels:
    """The operators built for ``isa`` ('avx512_bf16' or 'avx2'); the caller has checked that
    this CPU runs that ISA (``capability.py``). Built and probed once per process."""
    if isa not in FLAGS:
        raise ValueError(f"no kernel build for {isa!r}: choose one of {', '.join(FLAGS)}")
    if isa not in _built:
        try:
            _built[isa] = _build_and_probe(isa)
        except KernelsUnavailable as error:
            _built[isa] = error
    result = _built[isa]
    if isinstance(result, KernelsUnavailable):
        raise result
    return result


def loaded() -> list[Kernels]:
    """The builds this process has loaded."""
    return [built for built in _built.values() if isinstance(built, Kernels)]


def recipe(isa: str) -> Recipe:
    """How ``isa``'s library is built (its folder is named by a hash of all of it: ``build.py``)."""
    namespace = NAMESPACE[isa]
    common = ("-O3", "-fopenmp", f"-DBLOOM_OPS={namespace}")
    flag_sets = [FLAGS[isa] + AMX_FLAGS, FLAGS[isa]] if isa == "avx512_bf16" else [FLAGS[isa]]
    return Recipe(f"bloom_cpu_{namespace.removeprefix('bloom_')}", tuple(SOURCES),
                  tuple((*common, *flags) for flags in flag_sets), headers=tuple(sorted(CSRC.glob("*.h"))),
                  ldflags=("-fopenmp",))


def _build_and_probe(isa: str) -> Kernels:
    if not compiler_found():
        raise KernelsUnavailable("no C++ compiler to build them (install g++, or set CXX)")
    namespace = NAMESPACE[isa]
    try:
        load_library(recipe(isa), f"the {ISA_NAMES[isa]} CPU kernels", BUILD_TIME)
    except BuildError as error:
        raise KernelsUnavailable(str(error)) from None
    except OSError as error:  # the build folder cannot be written or locked
        raise KernelsUnavailable(f"could not be built ({error})") from None
    ops = getattr(torch.ops, namespace)
    try:
        kernels = Kernels(isa, ops.few_rows_linear, ops.decode_step, ops.prompt_attention, ops.extend_attention,
                          ops.int8_rows_linear, ops.int4_rows_linear, ops.int4_dequantize, ops.decode_step_quantized,
                          ops.enable_amx, ops.counter_uniform, ops.block_q8_quantize, ops.block_q8_linear, ops.gelu_tanh,
                          ops.set_prefetch, ops.prefetch_in_force, ops.prefetch_row_classes,
                          ops.set_q8_few_rows, ops.q8_few_rows_bounds)
    except AttributeError as error:  # a library built from other sources
        raise KernelsUnavailable(f"were built without their operators ({error})") from None
    _register_fake(namespace)
    try:
        for fmt in set(PREFETCH_FORMATS.values()):
            kernels.set_prefetch(PREFETCH_KINDS[weight_prefetch()], fmt)
    except ValueError as error:  # a malformed $BLOOM_CPU_PREFETCH
        raise KernelsUnavailable(str(error)) from None
    _probe(kernels)
    return kernels


def _register_fake(namespace: str) -> None:
    """The product's output shape, for torch.compile's tracing (it runs no kernel on fake tensors)."""

    @torch.library.register_fake(f"{namespace}::few_rows_linear")
    def _(x, w, bias):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake(f"{namespace}::int8_rows_linear")
    def _(x, q, scales, bias):
        return x.new_empty(*x.shape[:-1], q.shape[0])

    @torch.library.register_fake(f"{namespace}::int4_rows_linear")
    def _(x, q, scales, bias):
        return x.new_empty(*x.shape[:-1], q.shape[0])

    @torch.library.register_fake(f"{namespace}::block_q8_quantize")
    def _(x):
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(*x.shape[:-1], x.shape[-1] // 32, dtype=torch.float32)

    @torch.library.register_fake(f"{namespace}::block_q8_linear")
    def _(x, q, scales, bias):
        return x.new_empty(*x.shape[:-1], q.shape[0])

    @torch.library.register_fake(f"{namespace}::extend_attention")
    def _(qkv, starts, keys, values, alibi, last):
        return qkv.new_empty(qkv.shape[0], 1 if last is not None else qkv.shape[1], qkv.shape[2] // 3)

    @torch.library.register_fake(f"{namespace}::gelu_tanh")
    def _(x):
        return torch.empty_like(x)


def _probe(kernels: Kernels) -> None:
    """One small product per dtype must give F.linear's result."""
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        x = torch.randn(3, 64, generator=g).to(dtype)
        w = torch.randn(20, 64, generator=g).to(dtype)
        b = torch.randn(20, generator=g).to(dtype)
        try:
            got = kernels.few_rows_linear(x, w, b).float()
        except RuntimeError as error:
            raise KernelsUnavailable(f"the probe call failed ({str(error).splitlines()[0]})") from None
        want = F.linear(x.float(), w.float(), b.float())
        if not torch.allclose(got, want, rtol=2e-2, atol=0.1):
            raise KernelsUnavailable(f"the probe call gave wrong {dtype} products")
        q = torch.randint(-127, 128, (21, 64), generator=g, dtype=torch.int8)
        scales = torch.rand(21, generator=g) / 64
        try:
            got = kernels.int8_rows_linear(x, q, scales, None).float()
        except RuntimeError as error:
            raise KernelsUnavailable(f"the int8 probe call failed ({str(error).splitlines()[0]})") from None
        if not torch.allclose(got, F.linear(x.float(), q.float() * scales[:, None]), rtol=2e-2, atol=0.1):
            raise KernelsUnavailable(f"the int8 probe call gave wrong {dtype} products")
        packed = torch.randint(0, 256, (21, 32), generator=g, dtype=torch.uint8)
        group_scales = torch.rand(21, 2, generator=g) / 8
        try:
            got = kernels.int4_rows_linear(x, packed, group_scales, None).float()
            weight = torch.empty(21, 64)
            kernels.int4_dequantize(packed, group_scales, weight)
        except RuntimeError as error:
            raise KernelsUnavailable(f"the int4 probe call failed ({str(error).splitlines()[0]})") from None
        if not torch.equal(weight, dequantized_int4(packed, group_scales)) or \
                not torch.allclose(got, F.linear(x.float(), weight), rtol=2e-2, atol=0.1):
            raise KernelsUnavailable(f"the int4 probe call gave wrong {dtype} products")
        try:
            rounded = kernels.block_q8_quantize(x)
            got8 = kernels.block_q8_linear(x, q, scales, None).float()
            got4 = kernels.block_q8_linear(x, packed, group_scales, None).float()
        except RuntimeError as error:
            raise KernelsUnavailable(f"the integer probe call failed ({str(error).splitlines()[0]})") from None
        if not all(map(torch.equal, rounded, quantize_blocks(x))) or \
                not torch.allclose(got8, block_product(x, q, scales, None).float(), rtol=2e-2, atol=0.1) or \
                not torch.allclose(got4, block_product(x, packed, group_scales, None).float(), rtol=2e-2, atol=0.1):
            raise KernelsUnavailable(f"the integer probe call gave wrong {dtype} products")
