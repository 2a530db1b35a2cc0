"""Our one CPU kernel: products of a few rows with a large weight, bf16 or fp32
(``csrc/few_rows_linear.cpp``).

Decode multiplies one row per sequence by every weight once, so on a CPU its speed is the speed at
which the weights stream from memory. PyTorch's bf16 kernels read them at about half the memory's
bandwidth on a Xeon with AVX512-BF16; ours reads at about the bandwidth, and for small fp32 models
it saves PyTorch's ~10 us of overhead per product (see the .cpp file and docs/performance.md). It
serves products of at most ``FEW_ROWS`` rows: every decode step and the prefill's LM head. Larger
products (a prefill's blocks) are compute-bound and stay with oneDNN/MKL.

The kernel is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja, 15-30 s),
then loaded from PyTorch's extension cache. Where it cannot be had (no AVX512-BF16, no compiler,
``BLOOM_CPU_KERNEL=0``) ``load()`` returns None with the reason in ``unavailable_reason()``, and
the model keeps PyTorch's kernels: same results up to the order of float additions.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

FEW_ROWS = 16  # up to this many rows the kernel beat oneDNN on every bloom-560m shape measured
STEP = {torch.bfloat16: 32, torch.float32: 16}  # elements per 64-byte load: K must be a multiple
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("few_rows_linear.cpp", "decode_step.cpp", "prompt_attention.cpp")]
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]

_loaded: Callable | None = None
_reason: str | None = None  # why it is not loaded, once a load was tried


def cpu_supports_bf16_dot() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def compiler_found() -> bool:
    """The compiler torch.utils.cpp_extension will call ($CXX, else c++) is on the PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def unavailable_reason() -> str | None:
    return _reason


def load() -> Callable | None:
    """``few_rows_linear(x [..., K], w [N, K], bias [N] | None) -> [..., N]``, or None (see above)."""
    global _loaded, _reason
    if _loaded is not None or _reason is not None:
        return _loaded
    if os.environ.get("BLOOM_CPU_KERNEL", "1") == "0":
        _reason = "turned off by BLOOM_CPU_KERNEL=0"
    elif not cpu_supports_bf16_dot():
        _reason = "this CPU has no AVX512-BF16"
    elif not compiler_found():
        _reason = "no C++ compiler to build it (install g++, or set CXX)"
    else:
        try:
            _loaded = _build()
        except Exception as error:  # no compiler, old torch headers...: PyTorch's kernels serve
            last_line = (str(error).strip().splitlines() or [""])[-1]
            _reason = f"could not be built ({type(error).__name__}: {last_line})"
    return _loaded


def _build() -> Callable:
    from torch.utils import cpp_extension

    started = time.perf_counter()
    cpp_extension.load(
        name="bloom_cpu_kernels", sources=[str(path) for path in SOURCES], extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
    )
    elapsed = time.perf_counter() - started
    if elapsed > 5:  # a real compilation, not a load from the cache: say why the wait
        print(f"built the CPU kernels in {elapsed:.0f} s (cached from now on)", file=sys.stderr)
    op = torch.ops.bloom_cpu.few_rows_linear

    # The output's shape for torch.compile's tracing (it runs no kernel on fake tensors).
    @torch.library.register_fake("bloom_cpu::few_rows_linear")
    def _(x, w, bias):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    return op


def one_call_steps() -> bool:
    """The steps' one-call operators can be used: built with the kernel, and not turned off by
    ``BLOOM_CPU_STEP=0`` (which keeps the op-by-op steps, to compare)."""
    return load() is not None and os.environ.get("BLOOM_CPU_STEP", "1") != "0"


def decode_step_op() -> Callable | None:
    """The whole decode step in one call (``csrc/decode_step.cpp``, see
    ``StaticBloom.use_cpu_decode_step``), or None."""
    return torch.ops.bloom_cpu.decode_step if one_call_steps() else None


def prompt_attention_op() -> Callable | None:
    """A prefill's attention in one call (``csrc/prompt_attention.cpp``), or None."""
    return torch.ops.bloom_cpu.prompt_attention if one_call_steps() else None


def suits(weight: torch.Tensor) -> bool:
    """The kernel can multiply by this weight [N, K]: bf16 or fp32, contiguous, K elements filling
    whole 64-byte loads (the kernel's step). Decided once per weight, not per call."""
    step = STEP.get(weight.dtype)
    return step is not None and weight.dim() == 2 and weight.shape[1] % step == 0 and weight.is_contiguous()


def row_limit(weight: torch.Tensor) -> int:
    """Inputs of at most this many elements (``FEW_ROWS`` rows of K) go to the kernel."""
    return FEW_ROWS * weight.shape[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Callable | None):
    """``F.linear(x, weight, bias)``, through ``kernel`` (from ``load()``) when the weight ``suits``
    it and x [..., K] has at most ``FEW_ROWS`` rows. The model's LM head (one product a step) calls
    this; the blocks' linears make the weight check once (``Linear.use_few_rows``), since on small
    models each check here costs about what the product does."""
    if kernel is None or x.dtype != weight.dtype or not suits(weight) or x.numel() > row_limit(weight):
        return F.linear(x, weight, bias)
    return kernel(x, weight, bias)
