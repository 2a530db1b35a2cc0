"""Integer products (``--int8_activations``): the input of every quantized product rounded to int8
per block of 32 values, as llama.cpp's Q8_0 does, so that a CPU can multiply it by the int8 or
int4 weight with integer dot products (``runtime/cpu/csrc/block_q8.h``).

This module is the arithmetic's definition in public ops, which the cards (HPU, CUDA) and a CPU
without our kernels run, and which the kernels are tested against. For a product input x [..., K]
(K a multiple of 32), each block of 32 consecutive values of a row:

    amax = max |x|  (x widened to fp32)
    d = amax / 127              the block's scale (fp32)
    xq = round(x * (127 / amax))  int8 in [-127, 127], ties to even; 0 where amax is 0

and the product with weight w (int8 q [N, K] at row scales s [N], or int4 with a scale per group
of G weights) is, with float sums in any order,

    y[i, j] = sum over blocks b of  d[i, b] * s[j, b] * (sum over k in b of xq[i, k] * q[j, k])

plus the bias (fp32), rounded once to x's dtype. The integer sums of a block are exact; only the
activations' rounding (at most half a step of 1/254 of the block's largest value) changes the
result from weight-only quantization's.
"""

from __future__ import annotations

import contextlib
import contextvars
import torch
import torch.nn.functional as F

from .int4 import dequantized_int4

BLOCK = 32
QMAX = 127


NEEDS_QUANTIZED = ("--int8_activations goes with quantized weights (--quantize int8 or int4, or a checkpoint "
                   "saved quantized)")
# ``--int8_activations``: 'on' (every quantized product), 'off' (none: weight-only products), 'auto'
# (the default: on a CPU, whichever of the two its runtime measured faster, for prompts and for
# decode rows apart; on a card, off).
MODES = ("off", "on", "auto")


class Int8ActivationsError(ValueError):
    """A model that cannot take integer products (one line for the user)."""


def parse_mode(value: bool | str | None) -> str:
    """'off', 'on' or 'auto' from the library's argument (True and False are 'on' and 'off', None
    'auto'); raises Int8ActivationsError for anything else."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    raise Int8ActivationsError(f"int8_activations must be one of {', '.join(MODES)} (or True / False), got {value!r}")


# Speculation's verify pass computes a few tokens a row, but each stands for a decode step: inside
# ``as_decode_rows()`` its products take the decode rows' route, so its tokens are the plain loop's.
_AS_DECODE_ROWS = contextvars.ContextVar("as_decode_rows", default=False)


@contextlib.contextmanager
def as_decode_rows():
    token = _AS_DECODE_ROWS.set(True)
    try:
        yield
    finally:
        _AS_DECODE_ROWS.reset(token)


def prompt_shaped(x: torch.Tensor) -> bool:
    """x [B, T, K] with more than one token a row: a prompt's (prefill, extend, scoring) product.
    A decode step's are [B, 1, K] (the server's mixed step too: one token a row), the LM head's of
    a prefill [B, K]. Decided by the shape alone, so a row's route never depends on the rows beside
    it; a verify pass's (``as_decode_rows``) are decode rows whatever their shape."""
    return x.dim() >= 3 and x.shape[-2] > 1 and not _AS_DECODE_ROWS.get()


def takes_integer(module, x: torch.Tensor) -> bool:
    """Whether the quantized ``module``'s product with ``x`` is an integer one: with
    ``int8_activations`` on, for prompts where ``integer_prompts``, for decode rows where
    ``integer_decode`` (both True for '--int8_activations on'; the CPU runtime's measured choice
    sets them apart under 'auto')."""
    if not module.int8_activations:
        return False
    return module.integer_prompts if prompt_shaped(x) else module.integer_decode


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq int8 [..., K], d fp32 [..., K / 32]) of x [..., K]: the module doc's rounding."""
    *lead, k = x.shape
    blocks = x.float().reshape(*lead, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = amax / QMAX
    inverse = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inverse[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return xq.reshape(*lead, k), d


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the integer products see it: xq * d in fp32 ([..., K])."""
    xq, d = quantize_blocks(x)
    *lead, k = x.shape
    return (xq.float().reshape(*lead, k // BLOCK, BLOCK) * d[..., None]).reshape(*lead, k)


def block_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight.T + bias in x's dtype, the activations rounded per block: int8 q [N, K]
    with scales [N], or int4 packed q [N, K / 2] with scales [N, K / G] (``int4.py``). In public
    ops, computed in fp32 (no host sync, no shape that depends on values: graphs capture it)."""
    x32 = rounded(x)
    if q.dtype == torch.uint8:
        out = F.linear(x32, dequantized_int4(q, scales))
    else:
        out = F.linear(x32, q.float()) * scales.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def check_rows(products, world_size: int = 1) -> None:
    """Every quantized product's rows (this rank's part, under tensor parallelism) are whole blocks
    of 32, so that a rank's blocks are the ones one process rounds."""
    for module in products:
        q = module.embeddings.qweight if hasattr(module, "embeddings") else module.qweight
        k = q.shape[1] * (2 if q.dtype == torch.uint8 else 1)
        if k % BLOCK:
            where = " (this rank's part of a row)" if world_size > 1 else ""
            raise Int8ActivationsError(f"--int8_activations needs rows of a multiple of {BLOCK} values; "
                                       f"this model's have {k}{where}")
