"""The candidate routes of a product that ``choice.py`` times, and how each is set on a module.

Two shape classes, told apart by the input's shape (``int8_activations.prompt_shaped``):

* **prompts** (more than one token a row; timed at ``choice.PROMPT_ROWS``), over a float weight:
  'native' (oneDNN's or MKL's product in the model's dtype), 'widened' (bf16/fp16 weights widened to
  fp32 panels and multiplied in fp32: ``layers.WidenedProducts``), 'kernel' (our few-rows kernel for
  every row count); over a quantized weight: 'native' (weight-only: the kernel for the rows it serves,
  else the weight dequantized), 'widened' (weight-only, dequantized into fp32 panels), 'integer'
  (the activations rounded to int8 per block of 32: ``int8_activations.py``);
* **decode** (one token a row; timed at ``choice.DECODE_ROWS``), quantized weights only:
  'weight-only' or 'integer'.

Every candidate computes within the same contract (bf16 weights are exact in fp32; the integer
products' contract is in docs/performance.md), so the choice is speed alone. The timings run on a
sample of the model's own products: the first block's four linears, each cut to its first rows
(``SAMPLE_ELEMENTS`` weights at most, all of bloom-560m's), through their local product only (no
reduction across ranks, whatever a rank chooses).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from . import choice
from .layers import FEW_ROWS

SAMPLE_ELEMENTS = 1 << 22  # weights per sampled product: bloom-560m's largest (4096 x 1024) whole
# With the weight-only fp32 products of many rows, the quantized kernels keep the decode's rows.
WIDE_QUANTIZED_KERNEL_ROWS = FEW_ROWS
KERNEL_ANY_ROWS = 1 << 62  # elements: the few-rows kernel for every product


def is_quantized(module: nn.Module) -> bool:
    return getattr(module, "quantized", False)


def route_prompts(module: nn.Module, pick: str, wide, block_kernel: Callable | None) -> None:
    """Set ``pick`` as the route of ``module``'s prompt products (see the module doc)."""
    if is_quantized(module):
        module.wide = wide if pick == "widened" else None
        if pick == "widened" and module.kernel is not None:
            module.kernel_rows = min(module.kernel_rows, WIDE_QUANTIZED_KERNEL_ROWS)
        set_integer(module, prompts=pick == "integer", decode=module.__dict__.get("integer_decode", False),
                    block_kernel=block_kernel)
    else:
        module.wide = wide if pick == "widened" else None
        if pick == "kernel" and module.kernel is not None:
            module.few_rows_limit = KERNEL_ANY_ROWS


def route_decode(module: nn.Module, pick: str, block_kernel: Callable | None) -> None:
    set_integer(module, prompts=module.__dict__.get("integer_prompts", False), decode=pick == "integer",
                block_kernel=block_kernel)


def set_integer(module: nn.Module, prompts: bool, decode: bool, block_kernel: Callable | None) -> None:
    """Integer products of ``module`` for prompts and/or decode rows, marked as the runtime's own
    choice (``auto_integer``) so that a later ``accelerate`` can undo it (``clear_choice``)."""
    module.int8_activations = prompts or decode
    module.integer_prompts, module.integer_decode = prompts, decode
    module.auto_integer = True
    if prompts or decode:
        module.block_kernel = block_kernel


def clear_choice(module: nn.Module) -> None:
    """Undo what an earlier choice set on ``module`` (the user's ``--int8_activations on`` stays)."""
    for name in ("wide", "block_kernel"):
        module.__dict__.pop(name, None)
    if module.__dict__.pop("auto_integer", False):
        for name in ("int8_activations", "integer_prompts", "integer_decode"):
            module.__dict__.pop(name, None)


def sampled(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose weight is its first output rows (at most
    ``SAMPLE_ELEMENTS`` weights), sharing the original's memory: what a candidate sets on it leaves
    the model alone."""
    proxy = copy.copy(module)
    proxy._parameters, proxy._buffers = dict(module._parameters), dict(module._buffers)
    weight = module.qweight if is_quantized(module) else module.weight
    k = module.weight.shape[1]
    rows = min(weight.shape[0], max(FEW_ROWS, SAMPLE_ELEMENTS // k))
    if is_quantized(module):
        proxy.qweight, proxy.scales = module.qweight[:rows], module.scales[:rows]
    else:
        proxy.weight = nn.Parameter(module.weight.detach()[:rows], requires_grad=False)
    if module.bias is not None:
        proxy.bias = nn.Parameter(module.bias.detach()[:rows], requires_grad=False)
    return proxy


def timer(proxies: list[nn.Module], shapes: list[tuple[int, int]], dtype: torch.dtype,
          setup: Callable[[nn.Module], None]) -> Callable[[], float]:
    """A function that sets a candidate on ``proxies`` (``setup``) and returns the seconds their
    products take for inputs of each (batch, tokens) of ``shapes``."""
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(b, t, p.weight.shape[1], generator=g).to(dtype) for b, t in shapes] for p in proxies]

    def run() -> float:
        for proxy in proxies:
            setup(proxy)
        with torch.no_grad():
            return choice.timed(lambda: [p.product(x, p.bias) for p, xs in zip(proxies, inputs) for x in xs])

    return run


def prompt_shapes() -> list[tuple[int, int]]:
    return [(1, rows) for rows in choice.PROMPT_ROWS]


def decode_shapes() -> list[tuple[int, int]]:
    return [(rows, 1) for rows in choice.DECODE_ROWS]


def describe_sample(proxies: list[nn.Module]) -> list:
    """What of the sampled products decides their timings, for the cache's name."""
    out = []
    for p in proxies:
        weight = p.qweight if is_quantized(p) else p.weight
        out.append([type(p).__name__, list(weight.shape), str(weight.dtype),
                    list(p.scales.shape) if is_quantized(p) else None, p.weight.shape[1]])
    return out
