"""CPU variants of the model's layers, swapped into a finished model (as gpt-fast swaps in its
quantized linears): the model's own classes stay plain PyTorch.

* ``CpuLinear`` / ``CpuRowParallelLinear``: the product of a few rows (decode: bound by reading
  the weight) goes to our kernel; larger inputs (a prefill) to oneDNN, with the weight packed once
  in the layout its kernels read fastest where no kernel serves it, and with the MLP's GELU
  applied inside oneDNN's product where it can.
* ``CpuTiedHead``: the LM head's product of a few rows through the kernel.
* ``OneCallPromptAttention``: a prefill's attention in one C++ call (``csrc/prompt_attention.cpp``).

``swap(module, cls, **attributes)`` turns a module into its CPU variant in place: same parameters,
same name in the model, only the class and a few attributes change; ``unswap`` turns it back.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...model import Attention, Linear, TiedHead
from ...tp import RowParallelLinear

FEW_ROWS = 16  # up to this many rows the kernel beat oneDNN on every bloom-560m shape measured
# With AMX, oneDNN's bf16 products of more rows than this beat the kernel's AVX-512 loop (bloom-560m,
# 16 rows: a decode step 98 ms op by op through oneDNN against 140 ms in one call of the kernel).
FEW_ROWS_AMX = 8
# The kernel's bf16 products on AMX tiles (csrc/amx_rows.h): from AMX_MIN_ROWS rows (below, its
# AVX-512 loop is as fast), up to AMX_TILE_ROWS rows. One pass over bloom-560m's weights on 2
# Sapphire Rapids cores (bench/cpu_products_bench.py, two runs): at 16 rows 46-51 ms, against
# 95-101 for oneDNN and 162-217 for the AVX-512 loop; at 80 rows 106-212 against oneDNN's 139-300;
# at 128 rows 247-299 against 176: there oneDNN wins.
AMX_MIN_ROWS = 4
AMX_TILE_ROWS = 80


def kernel_suits(weight: torch.Tensor) -> bool:
    """The few-rows kernel can multiply by this weight [N, K]: its dtype, contiguous, K elements
    filling whole 64-byte loads (the kernel's step). Decided once per weight, not per call."""
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dim() != 2:
        return False
    return (weight.shape[1] * weight.element_size()) % 64 == 0 and weight.is_contiguous()


def swap(module: nn.Module, cls: type, **attributes) -> None:
    module.__class__ = cls
    for name, value in attributes.items():
        setattr(module, name, value)


def unswap(module: nn.Module) -> None:
    """Back to the model's own class (the CPU attributes stay, unused)."""
    module.__class__ = module.plain_class


class CpuProducts:
    """The product of ``Linear``, by input size: ``kernel`` for at most ``few_rows_limit``
    elements, else oneDNN's ``packed`` weight, else ``F.linear``. With ``fused_gelu`` the result
    is gelu_tanh(product), inside oneDNN's product for large inputs (the model's ``MLP.gelu`` is
    then swapped for an identity)."""

    kernel: Callable | None = None
    few_rows_limit = 0
    packed: torch.Tensor | None = None
    fused_gelu = False

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None and x.numel() <= self.few_rows_limit:
            out = self.kernel(x, self.weight, bias)
            return F.gelu(out, approximate="tanh") if self.fused_gelu else out
        if self.packed is None and not self.fused_gelu:
            return F.linear(x, self.weight, bias)
        weight = self.packed if self.packed is not None else self.weight
        # oneDNN reads the input as dense: make sure it is.
        activation, algorithm = ("gelu", "tanh") if self.fused_gelu else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, activation, [], algorithm)

    def pack(self) -> None:
        """Hand the weight to oneDNN once in its blocked layout (bit-identical results, 1.4x faster
        reads in bf16). The plain weight is dropped (a meta tensor keeps its shape and dtype): one
        copy of the weights in memory, not two."""
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)


class CpuLinear(CpuProducts, Linear):
    plain_class = Linear


class CpuRowParallelLinear(CpuProducts, RowParallelLinear):
    plain_class = RowParallelLinear


CPU_LINEAR = {Linear: CpuLinear, RowParallelLinear: CpuRowParallelLinear}


class CpuTiedHead(TiedHead):
    plain_class = TiedHead
    kernel: Callable | None = None
    few_rows_limit = 0

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.few_rows_limit:
            return self.kernel(x, weight, None)
        return F.linear(x, weight)


class OneCallPromptAttention(Attention):
    """The op-by-op ``Attention.attend_prompt`` as one call of ``op``, masked from the prompt's
    lengths; pad queries get zeros there (their output is never used)."""

    plain_class = Attention
    op: Callable | None = None

    def attend_prompt(self, qkv, layer, cache, prompt, last_only=False):
        return self.op(qkv, prompt.lengths, cache.keys[layer], cache.values[layer], cache.alibi, last_only)
