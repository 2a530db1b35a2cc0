"""CPU variants of the model's layers, swapped into a finished model (as gpt-fast swaps in its
quantized linears): the model's own classes stay plain PyTorch.

* ``CpuLinear`` / ``CpuRowParallelLinear``: the product of a few rows (decode: bound by reading
  the weight) goes to our kernel; larger inputs (a prefill) to oneDNN, with the weight packed once
  in the layout its kernels read fastest where no kernel serves it, and with the MLP's GELU
  applied inside oneDNN's product where it can.
* ``CpuTiedHead``: the LM head's product of a few rows through the kernel (widened where its routes say).
* ``OneCallPromptAttention``: a prefill's attention in one C++ call (``csrc/prompt_attention.cpp``).
* ``WidenedProducts``: on a CPU without native bf16 products, products over bf16, int8 and int4
  weights as fp32 products on the weight widened to fp32.

Which product a call takes follows the module's ``routes`` (``routes.RowRoutes``: by the input's
class and rows, as chosen by ``choice.py``); without them, the kernel for the rows it serves, else
oneDNN's or ATen's product in the model's dtype.

``swap(module, cls, **attributes)`` turns a module into its CPU variant in place: same parameters,
same name in the model, only the class and a few attributes change; ``unswap`` turns it back.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...int4 import dequantized_int4
from ...model import Attention, Linear, TiedHead
from ...tp import RowParallelLinear

FEW_ROWS = 16  # up to this many rows the kernel, which reads each weight once, beats oneDNN
# With AMX, oneDNN's bf16 products of more rows than this beat the kernel's AVX-512 loop: oneDNN
# multiplies on the tiles, the loop widens bf16 pairs in vector registers.
FEW_ROWS_AMX = 8
# The kernel's bf16 products on AMX tiles (csrc/amx_rows.h): from AMX_MIN_ROWS rows (below, its
# AVX-512 loop is as fast: the tiles' set-up costs what a few rows save), up to AMX_TILE_ROWS rows,
# past which oneDNN's blocking of many rows wins (bench/cpu_products_bench.py times each choice;
# docs/performance.md gives the figures).
AMX_MIN_ROWS = 4
AMX_TILE_ROWS = 80
# The most fp32 weights one panel of ``WidenedProducts`` holds (64 MiB): every weight of bloom-560m to
# bloom-7b1 at once (one fp32 product per layer call), panels of a few thousand rows beyond.
WIDE_PANEL_ELEMENTS = 1 << 24


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


class WidenedProducts:
    """Products as fp32 products, for a CPU whose bf16 products are slow (``Capability.emulates_bf16``:
    there PyTorch's bf16 product of a 128-token prompt takes several times its fp32 one); the
    routes say for which rows (``routes.py``). The weight is widened into fp32 scratch memory, reused by every
    layer in turn, a panel of at most ``panel_elements`` at a time (each panel's product over before
    the next is made); x is widened once per product; the product is ``torch.mm`` in fp32 (MKL's or
    oneDNN's sgemm), rounded once to x's dtype at the end.

    The numerics are the reference's, products of the bf16 (or dequantized) weights with float
    sums: bf16 weights and int8 values are exact in fp32, and int8's scales multiply the product's
    columns (``int8_product``'s order); an int4 weight is dequantized in fp32, ``(v - 8) * scale``
    unrounded, as the int4 kernel's sums use it on the AVX2 build (``csrc/int4_rows.h``;
    ``int4_product`` rounds it to x's dtype first: a difference of half a bf16 step per weight).
    Bias and the MLP's GELU are applied to the fp32 sums, as oneDNN's fused product does, before
    the one rounding."""

    def __init__(self, int4_dequantize: Callable | None = None, panel_elements: int = WIDE_PANEL_ELEMENTS):
        self.int4_dequantize = int4_dequantize  # the kernels' (q, scales, out), else public ops
        self.panel_elements = panel_elements
        self.buffer = torch.empty(0)  # the fp32 panel

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               gelu: bool = False) -> torch.Tensor:
        """x [..., K] @ weight [N, K].T + bias, then gelu_tanh with ``gelu``, in x's dtype."""
        return self._product(x, weight.shape[0], lambda panel, rows: panel.copy_(weight[rows]), None, bias, gelu)

    def quantized(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ the dequantized weight .T + bias in x's dtype: int8 q [N, K] with scales [N],
        or int4 packed q [N, K / 2] with scales [N, K / G] (``bloom_hpu/int4.py``)."""
        if q.dtype != torch.uint8:
            return self._product(x, q.shape[0], lambda panel, rows: panel.copy_(q[rows]), scales, bias)
        return self._product(x, q.shape[0], lambda panel, rows: self._dequantize_int4(q[rows], scales[rows], panel),
                             None, bias)

    def _dequantize_int4(self, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        if self.int4_dequantize is not None:
            self.int4_dequantize(q, scales, out)
        else:
            out.copy_(dequantized_int4(q, scales))

    def _product(self, x: torch.Tensor, n: int, fill: Callable, column_scales: torch.Tensor | None,
                 bias: torch.Tensor | None, gelu: bool = False) -> torch.Tensor:
        """The product with an [n, K] weight, ``fill(panel, rows)`` writing its ``rows`` (a slice)
        widened to fp32 into ``panel``."""
        k = x.shape[-1]
        x32 = x.reshape(-1, k).float()
        out = torch.empty(x32.shape[0], n)
        step = max(1, min(n, self.panel_elements // k))
        if self.buffer.numel() < step * k:
            self.buffer = torch.empty(step * k)
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            panel = self.buffer[: (rows.stop - start) * k].view(-1, k)
            fill(panel, rows)
            target = out if step == n else out[:, rows]
            if bias is None or column_scales is not None:
                torch.mm(x32, panel.t(), out=target)
            else:
                torch.addmm(bias[rows].float(), x32, panel.t(), out=target)
        if column_scales is not None:
            out.mul_(column_scales)
            if bias is not None:
                out.add_(bias.float())
        if gelu:
            out = F.gelu(out, approximate="tanh")
        return out.to(x.dtype).view(*x.shape[:-1], n)


def route_of(module, x: torch.Tensor) -> str:
    """The pick of ``module``'s routes for input ``x`` ('native' without routes)."""
    return module.routes.pick(x) if module.routes is not None else "native"


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused_gelu: bool) -> torch.Tensor:
    """oneDNN's product of x [..., K] with ``weight`` (plain [N, K], or packed by ``pack``), its
    tanh GELU inside with ``fused_gelu``."""
    activation, algorithm = ("gelu", "tanh") if fused_gelu else ("none", "")
    # oneDNN reads the input as dense: make sure it is.
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, activation, [], algorithm)


class CpuProducts:
    """The product of ``Linear``, by its route (``route_of``): 'widened', ``wide``'s fp32 product;
    'kernel', ``kernel``; 'native', ``kernel`` for at most ``few_rows_limit`` elements, else
    oneDNN's ``packed`` weight, else ``F.linear``; 'onednn', as 'native' but oneDNN's product on the
    plain weight in place of ``F.linear`` (fp32: torch's F.linear is MKL's, which oneDNN's beats
    on some CPUs). With ``fused_gelu`` the result is gelu_tanh(product), inside oneDNN's product
    for large inputs (the model's ``MLP.gelu`` is then swapped for an identity)."""

    kernel: Callable | None = None
    few_rows_limit = 0
    packed: torch.Tensor | None = None
    fused_gelu = False
    wide: WidenedProducts | None = None
    routes = None  # routes.RowRoutes, set by the runtime's choice

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        route = route_of(self, x)
        if route == "widened":
            return self.wide.linear(x, self.weight, bias, self.fused_gelu)
        if (route == "kernel" and self.kernel is not None) or self.kernel_serves(x.numel() // x.shape[-1]):
            out = self.kernel(x, self.weight, bias)
            return F.gelu(out, approximate="tanh") if self.fused_gelu else out
        if route == "onednn" or self.packed is not None or self.fused_gelu:
            return onednn_product(x, self.packed if self.packed is not None else self.weight, bias, self.fused_gelu)
        return F.linear(x, self.weight, bias)

    def kernel_serves(self, rows: int) -> bool:
        """Whether ``product`` gives inputs of up to ``rows`` rows to the few-rows kernel whatever
        the route (its first test, there on the input's elements)."""
        return self.kernel is not None and rows * self.weight.shape[1] <= self.few_rows_limit

    def pack(self) -> None:
        """Hand the weight to oneDNN once in its blocked layout (bit-identical results; oneDNN
        reads it without reordering it at every call). The plain weight is dropped (a meta tensor keeps its shape and dtype): one
        copy of the weights in memory, not two."""
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)


class CpuLinear(CpuProducts, Linear):
    plain_class = Linear


class CpuRowParallelLinear(CpuProducts, RowParallelLinear):
    plain_class = RowParallelLinear


CPU_LINEAR = {Linear: CpuLinear, RowParallelLinear: CpuRowParallelLinear}


class KernelGelu(nn.Module):
    """The MLP's GELU (``nn.GELU(approximate="tanh")``) by the kernels' ``gelu_tanh``: the decode
    step's formula, split over the threads. For prefills whose product does not fuse it, where
    ATen's GELU is a tenth of an integer-products prompt (quantized and bf16/fp16 models)."""

    def __init__(self, gelu_tanh: Callable):
        super().__init__()
        self.gelu_tanh = gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gelu_tanh(x)


class CpuTiedHead(TiedHead):
    """The LM head: ``wide``'s product where its routes pick 'widened' (their decode rows never
    do: its product is not among those timed), else the kernel for at most ``few_rows_limit``
    elements, else ``F.linear``."""

    plain_class = TiedHead
    kernel: Callable | None = None
    few_rows_limit = 0
    wide: WidenedProducts | None = None
    routes = None

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if route_of(self, x) == "widened":
            return self.wide.linear(x, weight, None)
        if self.kernel is not None and x.numel() <= self.few_rows_limit:
            return self.kernel(x, weight, None)
        return F.linear(x, weight)


class OneCallPromptAttention(Attention):
    """The op-by-op ``Attention.attend_prompt`` as one call of ``op``, masked from the prompt's
    lengths; pad queries get zeros there (their output is never used). And ``Attention.extend``
    (a prefix cache's hit) as one call of ``extend_op``: attention over the slots each row holds,
    not the whole cache's window, with no score tensor."""

    plain_class = Attention
    op: Callable | None = None
    extend_op: Callable | None = None

    def attend_prompt(self, qkv, layer, cache, prompt, last_only=False):
        return self.op(qkv, prompt.lengths, cache.keys[layer], cache.values[layer], cache.alibi, last_only)

    def extend(self, x, layer, cache, slots, window, bias, last=None):
        if self.extend_op is None or cache.per_layer:
            return super().extend(x, layer, cache, slots, window, bias, last)
        # slots [B, R]: each row's rest at starts[b] = slots[b, 0] onwards; every query attends
        # only slots up to its own, all below ``window`` (the whole cache, in ``ExtendStep``).
        return self.dense(self.extend_op(self.query_key_value(x), slots[:, 0].contiguous(), cache.keys[layer],
                                         cache.values[layer], cache.alibi, last))
