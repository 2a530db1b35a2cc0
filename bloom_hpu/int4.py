"""Group-wise int4 weights: the packed layout, quantizing into it and back (``quantize.py`` swaps the
layers that hold them into the model).

A weight [N, K] keeps one fp32 scale per group of G consecutive weights of a row (scales
[N, K / G]): ``scale = max|w| / 7`` over the group, ``q = round(w / scale)`` in [-7, 7] (symmetric,
no zero point). Each q is stored as ``v = q + 8`` in a nibble, two per byte: packed [N, K / 2]
uint8, where in each block of 32 weights of a row (16 bytes) byte j holds weight j in its low
nibble and weight j + 16 in its high one. That order lets the CPU kernels widen a block's two
halves without shuffling (``runtime/cpu/csrc/int4_rows.h``); here it is plain tensor ops, which
also serve the cards (HPU, CUDA): no host sync and no shape that depends on values.

Tensor parallelism: a group never crosses a shard boundary (``check_group_size``), so the
scales of a rank's slice are the ones one process computes for the same weights.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

QMAX = 7
BLOCK = 32  # weights per packed block; a group is a whole number of blocks
GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 64


class GroupSizeError(ValueError):
    """A group size the weights cannot take (one line for the user)."""


def check_group_size(group_size: int, rows: dict[str, int]) -> None:
    """``rows``: {what: row length} of every weight to be quantized as one rank holds it."""
    if group_size not in GROUP_SIZES:
        raise GroupSizeError(f"int4 group size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    for what, length in rows.items():
        if length % group_size:
            raise GroupSizeError(f"int4 group size {group_size} does not divide the rows of {what} "
                                 f"({length} weights); choose a smaller group size")


def group_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K / G] float32 scales of a [N, K] weight: max|w| / 7 per group."""
    rows, cols = weight.shape
    peak = weight.detach().float().abs().view(rows, cols // group_size, group_size).amax(dim=-1)
    return (peak / QMAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_groups(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The packed [N, K / 2] uint8 weight of ``weight`` [N, K] at ``scales`` [N, K / G]."""
    rows, cols = weight.shape
    groups = scales.shape[1]
    q = torch.round(weight.detach().float().view(rows, groups, cols // groups) / scales[..., None])
    return pack(q.clamp(-QMAX, QMAX).view(rows, cols).to(torch.int8))


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] -> uint8 [N, K / 2] in the layout of the module doc."""
    rows, cols = q.shape
    v = (q.to(torch.int16) + 8).to(torch.uint8).view(rows, cols // BLOCK, 2, BLOCK // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(rows, cols // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> int8 [N, K], the q that ``pack`` stored."""
    rows, half = packed.shape
    blocks = packed.view(rows, half // (BLOCK // 2), BLOCK // 2)
    v = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).view(rows, 2 * half)
    return v.to(torch.int8) - 8


def dequantized_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` computed in fp32, then cast: [N, K] (the weights transformers is checked against)."""
    rows, groups = scales.shape
    q = unpack(packed).float().view(rows, groups, -1)
    return (q * scales[..., None]).view(rows, -1).to(dtype)


Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 dequantize: Dequantize | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized(packed, scales).T in x's dtype: the weight dequantized for this
    product (by ``dequantize``, the CPU kernels' one, or by ``dequantized_int4``'s public ops)."""
    weight = (dequantize or dequantized_int4)(packed, scales, x.dtype)
    return F.linear(x, weight)
