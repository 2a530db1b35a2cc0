"""Which of our kernel builds this machine's tests run: every ISA the CPU can execute (an AVX-512
CPU runs the AVX2 build too), so both builds are tested wherever both can run; a test of a build
the CPU lacks is skipped, and says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from bloom_hpu.runtime.cpu import capability
from bloom_hpu.runtime.cpu.kernels import compiler_found

ROOT = Path(__file__).resolve().parent.parent
ALL_KERNEL_ISAS = ("avx512_bf16", "avx2")
KERNEL_ISAS = [isa for isa in ALL_KERNEL_ISAS if capability.detect().can_run(isa) and compiler_found()]


def needs_isa(isa: str) -> None:
    """Skip the calling test where this CPU (or a missing compiler) rules out ``isa``'s build."""
    if isa not in KERNEL_ISAS:
        pytest.skip(f"{isa} kernels cannot run here ({capability.detect().why}; compiler found: {compiler_found()})")


def needs_amx_tiles():
    """Skip the calling test unless our AVX-512 kernels can run their bf16 products on AMX tiles
    here (a CPU with AMX-BF16 whose process Linux grants the tile state); else turn them on (from
    ``AMX_MIN_ROWS`` rows, as ``accelerate`` does) and return the kernels."""
    needs_isa("avx512_bf16")
    from bloom_hpu.runtime.cpu.kernels import load
    from bloom_hpu.runtime.cpu.layers import AMX_MIN_ROWS

    kernels = load("avx512_bf16")
    if not (capability.detect().amx and kernels.enable_amx(AMX_MIN_ROWS)):
        pytest.skip(f"no AMX tiles here ({capability.detect().why})")
    return kernels
