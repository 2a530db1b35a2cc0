"""ALiBi: the per-head linear position bias BLOOM uses instead of position embeddings.

Each head h adds ``slope[h] * key_position`` to its attention scores. Softmax is invariant to a
constant added along a query's row, so the bias only needs the absolute key position; the query
position (``- slope * q``) cancels out. Because our prompts are right-padded, a row's real tokens
always start at slot 0, so the absolute slot index *is* the token position and the bias can be built
once per cache shape and reused by every step.
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Slopes for ``n_head`` heads, float32, shape [n_head].

    For a power of two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ... For other
    head counts (bloom-7b1 has 32 = 2^5, but bloom has 112, and 12 or 14 occur in small configs),
    the ALiBi paper takes the slopes of the closest lower power of two p, then fills the remaining
    heads with every other slope of the 2p sequence. This matches transformers' BLOOM.
    """
    if n_head < 1:
        raise ValueError(f"n_head must be positive, got {n_head}")
    closest_pow2 = 2 ** math.floor(math.log2(n_head))

    def geometric(first_exponent_base: float, powers: range) -> torch.Tensor:
        # float32 pow, as transformers computes them, so the slopes agree to the last bit.
        base = torch.tensor(first_exponent_base, dtype=torch.float32)
        return torch.pow(base, torch.tensor(list(powers), dtype=torch.int32))

    slopes = geometric(2.0 ** (-(2.0 ** -(math.log2(closest_pow2) - 3))), range(1, closest_pow2 + 1))
    if closest_pow2 != n_head:
        n_extra = min(closest_pow2, n_head - closest_pow2)
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest_pow2) - 3)))
        slopes = torch.cat([slopes, geometric(extra_base, range(1, 2 * n_extra, 2))])
    return slopes


def alibi_bias(slopes: torch.Tensor, length: int, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Bias for keys at slots 0..length-1, shape [batch_size * heads, 1, length], in ``dtype``.

    Laid out as transformers does ([B*H, 1, K]) so ``torch.baddbmm`` can add it while computing
    the scores; rounding to ``dtype`` happens after the float32 product, as there.
    """
    positions = torch.arange(length, device=slopes.device, dtype=torch.float32)
    bias = slopes.float()[:, None] * positions[None, :]  # [H, K]
    return bias[None].expand(batch_size, -1, -1).reshape(-1, 1, length).to(dtype).contiguous()
