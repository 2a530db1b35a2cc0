"""What this CPU and this torch build can really do: the instruction set our kernels are built
for, and whether the oneDNN operations a fallback path relies on work here.

Nothing is assumed from the presence of an attribute: the ISA comes from the CPU's own flags,
capped by the level PyTorch itself dispatches to (``torch.backends.cpu.get_cpu_capability()``,
which ``ATEN_CPU_CAPABILITY=avx2`` lowers: that is how an AVX-512 machine is made to run as an
AVX2 one, PyTorch's kernels included), and each oneDNN operation is called once on a small input
and its result compared with ``F.linear``'s.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Kernel builds, fastest first, and the CPU flags each needs.
KERNEL_ISAS = {
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}
ISA_NAMES = {"avx512_bf16": "AVX512-BF16", "avx512": "AVX-512", "avx2": "AVX2", "other": "no AVX2"}
# The levels, lowest first: a CPU of a level runs everything below it.
ISA_ORDER = ("other", "avx2", "avx512", "avx512_bf16")
# Each level of torch's dispatch and the most our kernels may use under it.
TORCH_LEVELS = {"AVX512": "avx512_bf16", "AVX2": "avx2"}


@dataclass(frozen=True)
class Capability:
    """``isa``: 'avx512_bf16', 'avx512' (AVX-512 without BF16: runs the AVX2 kernels), 'avx2' or
    'other' (another architecture, or an x86 CPU without AVX2+FMA+F16C). ``why``: how it was found."""

    isa: str
    why: str
    amx: bool = False  # AMX tiles for bf16 (oneDNN's products of many rows use them)

    @property
    def kernel_isa(self) -> str | None:
        """The kernel build this CPU runs best, or None (PyTorch's operations only)."""
        return {"avx512_bf16": "avx512_bf16", "avx512": "avx2", "avx2": "avx2"}.get(self.isa)

    def can_run(self, kernel_isa: str) -> bool:
        needed = "avx512_bf16" if kernel_isa == "avx512_bf16" else "avx2"
        return ISA_ORDER.index(self.isa) >= ISA_ORDER.index(needed)

    @property
    def name(self) -> str:
        return ISA_NAMES[self.isa]

    @property
    def emulates_bf16(self) -> bool:
        """PyTorch's bf16 products of many rows are emulated here: an x86 CPU with AVX2 but without
        AVX512-BF16 (or oneDNN capped below it by ``ONEDNN_MAX_CPU_ISA``), where oneDNN and ATen
        widen each operand and multiply at a fraction of their fp32 products' speed. Elsewhere
        (another architecture) nothing is assumed: False."""
        if self.isa in ("avx2", "avx512"):
            return True
        return self.isa == "avx512_bf16" and onednn_capped_below_bf16()


# oneDNN's ISA caps (``ONEDNN_MAX_CPU_ISA``) below its first with bf16 products (AVX512_CORE_BF16).
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")


def onednn_cap() -> str:
    """``ONEDNN_MAX_CPU_ISA`` (oneDNN's own switch, read when it starts), upper case; '' if unset."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()


def onednn_capped_below_bf16() -> bool:
    """``ONEDNN_MAX_CPU_ISA`` rules out oneDNN's bf16 products."""
    return onednn_cap() in ONEDNN_ISAS_WITHOUT_BF16


# oneDNN's ISA caps below its first with AMX tiles.
ONEDNN_ISAS_WITHOUT_AMX = ONEDNN_ISAS_WITHOUT_BF16 + ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512")


def onednn_capped_below_amx() -> bool:
    """``ONEDNN_MAX_CPU_ISA`` rules out AMX: then our kernels leave the tiles alone too, so that one
    switch runs a CPU with AMX as one without (an AMD Zen 4) does."""
    return onednn_cap() in ONEDNN_ISAS_WITHOUT_AMX


def cpuinfo_field(name: str) -> str | None:
    """The value of the first CPU's ``name`` line in /proc/cpuinfo (Linux), or None where there is
    no such file or line."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name) and ":" in line:
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> set[str] | None:
    """The flags of the first CPU in /proc/cpuinfo (Linux), or None where there is none."""
    flags = cpuinfo_field("flags")
    return None if flags is None else set(flags.split())


def cpu_vendor() -> str | None:
    """The first CPU's vendor_id ('GenuineIntel', 'AuthenticAMD'), or None."""
    return cpuinfo_field("vendor_id")


# How the few-rows products prefetch the weight rows still to come (csrc/prefetch.h's PrefetchKind),
# each weight format's own (its WeightFormat).
PREFETCH_KINDS = {"none": 0, "l1": 1, "l2": 2}
PREFETCH_FORMATS = {"bf16": 0, "fp16": 0, "fp32": 0, "int8": 1, "int4": 2}
PREFETCH_ENV = "BLOOM_CPU_PREFETCH"


def weight_prefetch() -> str:
    """'l2' (into L2, the next block of weight rows) on AMD CPUs, where it streams a decode's
    weights at up to twice the speed of 'l1' (into L1, further along the same rows), which is what
    the Xeons were measured at the memory's speed with and keep (the rule of thumb: the measured
    choice, ``prefetch.py``, also weighs 'none'). ``$BLOOM_CPU_PREFETCH`` (none, l1 or l2) forces one."""
    forced = os.environ.get(PREFETCH_ENV, "").strip().lower()
    if forced:
        if forced not in PREFETCH_KINDS:
            raise ValueError(f"{PREFETCH_ENV}={forced!r}: choose {', '.join(PREFETCH_KINDS)}")
        return forced
    return "l2" if cpu_vendor() == "AuthenticAMD" else "l1"


@functools.lru_cache(maxsize=1)
def detect() -> Capability:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return Capability("other", f"{machine} CPU: PyTorch's operations")
    torch_level = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    if flags is None:  # no /proc/cpuinfo: trust torch's level, without AVX512-BF16 (it cannot tell)
        isa = "avx2" if torch_level in TORCH_LEVELS else "other"
        return Capability(isa, f"torch dispatches to {torch_level}; CPU flags unreadable")
    hardware = "other"
    if all(f in flags for f in KERNEL_ISAS["avx2"]):
        hardware = "avx2"
    if "avx512f" in flags and hardware == "avx2":
        hardware = "avx512"
    if all(f in flags for f in KERNEL_ISAS["avx512_bf16"]):
        hardware = "avx512_bf16"
    ceiling = TORCH_LEVELS.get(torch_level, "other")
    isa = min(hardware, ceiling, key=ISA_ORDER.index)
    why = f"CPU flags: {ISA_NAMES[hardware]}"
    if isa != hardware:
        why += f", capped by torch's {torch_level} dispatch"
    amx = isa == "avx512_bf16" and "amx_bf16" in flags
    if amx and onednn_capped_below_amx():
        amx = False
        why += ", AMX ruled out by ONEDNN_MAX_CPU_ISA"
    return Capability(isa, why + (" with AMX" if amx else ""), amx)


def agrees_with_linear(run, dtype: torch.dtype, gelu: bool = False) -> bool:
    """``run(x, w, bias) -> y`` gives F.linear's result (its tanh GELU with ``gelu``) for a small
    input in ``dtype``, without raising: the probe of every operation a path relies on."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 64, generator=g).to(dtype)
    w = torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    try:
        with torch.no_grad():
            got = run(x, w, b)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
    want = F.linear(x.float(), w.float(), b.float())
    if gelu:
        want = F.gelu(want, approximate="tanh")
    return got.shape == want.shape and torch.allclose(got.float(), want, rtol=2e-2, atol=0.25)


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN's packed-weight linear (``mkldnn._reorder_linear_weight`` + ``_linear_pointwise``,
    private operations) exists and computes F.linear in ``dtype`` here. On a CPU without AVX-512 it
    refuses bf16 weights."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
        return False

    def packed(x, w, b):
        return ops._linear_pointwise(x, ops._reorder_linear_weight(w, x.shape[0]), b, "none", [], "")

    return agrees_with_linear(packed, dtype)


@functools.lru_cache(maxsize=None)
def onednn_plain_linear(dtype: torch.dtype, gelu: bool = False) -> bool:
    """oneDNN's linear (``mkldnn._linear_pointwise``, a private operation) takes a plain weight in
    ``dtype`` and computes F.linear here (with ``gelu``: and its tanh GELU inside the product)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")):
        return False
    activation, algorithm = ("gelu", "tanh") if gelu else ("none", "")
    return agrees_with_linear(lambda x, w, b: ops._linear_pointwise(x, w, b, activation, [], algorithm), dtype,
                              gelu=gelu)


def onednn_fuses_gelu(dtype: torch.dtype) -> bool:
    """oneDNN applies a tanh GELU inside a product of plain weights in ``dtype`` here."""
    return onednn_plain_linear(dtype, gelu=True)
