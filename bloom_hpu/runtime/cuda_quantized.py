"""Weight-only int8 and int4 products of a few rows on an NVIDIA card, as Triton kernels that read
the quantized weight once.

Without them a card dequantizes the whole weight into a bf16 copy for each product (public ops,
``quantize.int8_product`` / ``int4_product``): three passes over the weight's size instead of one,
which makes a decode step slower than bf16's. These kernels widen each tile of the weight in
registers and multiply it there, so a decode step reads 1 byte (int8) or half a byte (int4) per
weight. They serve up to ``KERNEL_ROWS`` rows (decode steps); longer products (prefill) keep the
public ops, where the product, not the weight's read, is the cost.

Numerics are those of the reference (``quantize.dequantized`` / ``int4.dequantized_int4``):

* int8: ``(x @ q.T) * scale`` with the sum in fp32 and the row scale applied to it in fp32, then
  rounded once (the public ops round the sum to x's dtype first, which in fp16 can overflow);
* int4: each weight ``q * group scale`` in fp32, cast to x's dtype, then the product, sum in fp32.

The packed int4 layout (``int4.py``): in each block of 32 weights of a row (16 bytes), byte j holds
weight j in its low nibble and weight j + 16 in its high one. The kernel multiplies the low nibbles
by the x values of their weights and the high ones by theirs, so nothing is shuffled.

Imported only on CUDA (``CudaBackend.prepare_model``), and only where Triton is installed; every
product is checked against the public ops on the card before the kernels are used (``install``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_ROWS = 16  # a product of at most this many rows goes through the kernels (tl.dot's smallest M)
BLOCK_K = 256  # int8: weights of a row per loop step

# Output columns per program and the pipeline's depth, chosen per weight shape on its first product
# (outside any graph capture: at load, by ``install``'s probe): a narrow layer needs narrow tiles to
# give every multiprocessor work, a wide one fewer, larger loads.
CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
           for n, w, s in ((16, 2, 4), (32, 4, 4), (64, 4, 3), (32, 4, 2))]


@triton.autotune(configs=CONFIGS, key=["N", "K"])
@triton.jit
def _int8_rows(x_ptr, q_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_om,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        q = tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0)
        acc += tl.dot(x, tl.trans(q.to(x.dtype)))
    # The row scale multiplies the fp32 sum before any rounding: a sum of int8 weights times
    # activations can pass fp16's range before it is scaled down.
    scale = tl.load(s_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.autotune(configs=CONFIGS, key=["N", "K"])
@triton.jit
def _int4_rows(x_ptr, p_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_om,
               GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One loop step per group of GROUP weights (a whole number of 32-weight blocks), so each row of
    # the tile has one scale there, broadcast rather than gathered.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    in_n = cols < N
    half = tl.arange(0, GROUP // 2)  # byte t of the group: block t // 16, position t % 16 in it
    low_k = (half // 16) * 32 + half % 16  # the weight in the byte's low nibble; +16: the high one
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        k0 = g * GROUP
        packed = tl.load(p_ptr + cols[:, None] * stride_pn + (k0 // 2 + half)[None, :],
                         mask=in_n[:, None], other=0x88).to(tl.int32)
        scale = tl.load(s_ptr + cols * stride_sn + g, mask=in_n, other=0.0)[:, None]
        x_low = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + low_k)[None, :],
                        mask=rows[:, None] < M, other=0.0)
        x_high = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + 16 + low_k)[None, :],
                         mask=rows[:, None] < M, other=0.0)
        w_low = (((packed & 0x0F) - 8).to(tl.float32) * scale).to(x_low.dtype)
        w_high = (((packed >> 4) - 8).to(tl.float32) * scale).to(x_low.dtype)
        acc += tl.dot(x_low, tl.trans(w_low))
        acc += tl.dot(x_high, tl.trans(w_high))
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=in_n, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=(rows[:, None] < M) & in_n[None, :])


def quantized_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most KERNEL_ROWS rows) times the int8 [N, K] or packed int4 [N, K / 2]
    weight, plus ``bias``: [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    rows, k = flat.shape
    n = q.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    if q.dtype == torch.uint8:
        _int4_rows[grid](flat, q, scales, bias_arg, out, rows, n, k, flat.stride(0), q.stride(0),
                         scales.stride(0), out.stride(0), GROUP=k // scales.shape[1], HAS_BIAS=has_bias,
                         BLOCK_M=KERNEL_ROWS)
    else:
        _int8_rows[grid](flat, q, scales, bias_arg, out, rows, n, k, flat.stride(0), q.stride(0),
                         out.stride(0), HAS_BIAS=has_bias, BLOCK_M=KERNEL_ROWS, BLOCK_K=BLOCK_K)
    return out.view(*x.shape[:-1], n)


def _agrees(module, dtype: torch.dtype) -> bool:
    """One product of ``module``'s weight by the kernel and by the public ops, on the card."""
    from ..quantize import routed_product
    q, scales = _weight_of(module)
    x = torch.randn(3, q.shape[1] * (2 if q.dtype == torch.uint8 else 1), device=q.device).to(dtype)
    kernel, module.kernel = module.kernel, None
    try:
        expected = routed_product(module, x, q, scales, None).float()
    finally:
        module.kernel = kernel
    got = quantized_rows(x, q, scales).float()
    return bool(torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()))


def _weight_of(module):
    if hasattr(module, "qweight"):
        return module.qweight, module.scales
    return module.embeddings.qweight, module.embeddings.scales  # the tied head


def install(model, dtype: torch.dtype) -> bool:
    """Route ``model``'s quantized products of a few rows through the kernels, once a probe product
    of each distinct weight shape agrees with the public ops; False (nothing changed) otherwise."""
    from ..quantize import quantized_products
    products = quantized_products(model)
    if not products or dtype not in (torch.bfloat16, torch.float16):
        return False
    checked = {}
    for module in products:
        q, _ = _weight_of(module)
        key = (tuple(q.shape), q.dtype)
        if key not in checked:
            checked[key] = _agrees(module, dtype)
        if not checked[key]:
            return False
    for module in products:
        module.kernel, module.kernel_rows = quantized_rows, KERNEL_ROWS
    return True
