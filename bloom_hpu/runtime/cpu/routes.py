"""The candidate routes of a product that ``choice.py`` times, and how the picks are set on a model.

Two shape classes, told apart by the input's shape (``int8_activations.prompt_shaped``) and rows:

* **prompts** (more than one token a row, and a decode of more than ``DECODE_MOST`` rows), picked
  per bucket of rows (``PROMPT_BUCKETS``: 1-16, 17-64, 65 and more; each timed at one row count),
  over a float weight: 'native' (oneDNN's or MKL's product in the model's dtype; our few-rows
  kernel for the rows it serves), 'widened' (bf16/fp16 weights widened to fp32 panels and
  multiplied in fp32: ``layers.WidenedProducts``), 'kernel' (our few-rows kernel for every row
  count), 'onednn' (fp32 weights: 'native' with oneDNN's product on the plain weight where
  'native' calls F.linear, which is MKL's); over a quantized weight: 'native' (weight-only: the
  kernel for the rows it serves, else the weight dequantized), 'widened' (weight-only, dequantized
  into fp32 panels), 'integer' (the activations rounded to int8 per block of 32:
  ``int8_activations.py``);
* **decode** (one token a row, at most ``DECODE_MOST`` rows; timed at 1, 4 and 16 rows), over a
  bf16/fp16 weight: 'native' or 'widened'; over a quantized weight: 'weight-only' or 'integer'.

The float routes agree within float tolerance (bf16 weights are exact in fp32; they differ in where
sums are rounded), so each bucket takes its fastest. Integer products keep a wider contract
(docs/performance.md): they are picked for every prompt bucket or none (``TOGETHER``), so that a
prompt's tokens never depend on the rows of the prompts beside it in a batch.

The timings run on a sample of the model's own products: the first block's four linears, each cut
to its first rows (``SAMPLE_ELEMENTS`` weights at most, all of bloom-560m's), through their local
product only (no reduction across ranks; under tensor parallelism rank 0's pick is every rank's:
``choice.agree``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...int8_activations import prompt_shaped
from . import choice
from .layers import FEW_ROWS, WidenedProducts

SAMPLE_ELEMENTS = 1 << 22  # weights per sampled product: bloom-560m's largest (4096 x 1024) whole
# (the most rows of a bucket, None: no limit; the rows it is timed at). Their rows timed add up to
# about what one prompt timing of 8 + 32 + 128 rows cost before the buckets.
PROMPT_BUCKETS = ((16, 16), (64, 32), (None, 128))
DECODE_ROWS = (1, 4, 16)
DECODE_MOST = FEW_ROWS  # a decode of more rows (a server's batch) takes its prompt bucket's route
TOGETHER = ("integer",)  # picked for every prompt bucket or none (see the module doc)


def bucket_key(index: int) -> str:
    """'prompts:1-16', 'prompts:17-64', 'prompts:65+': the choice's key of a prompt bucket."""
    most = PROMPT_BUCKETS[index][0]
    least = 1 if index == 0 else PROMPT_BUCKETS[index - 1][0] + 1
    return f"prompts:{least}-{most}" if most is not None else f"prompts:{least}+"


PROMPT_KEYS = tuple(bucket_key(i) for i in range(len(PROMPT_BUCKETS)))


def bucket_of(rows: int) -> int:
    return next(i for i, (most, _) in enumerate(PROMPT_BUCKETS) if most is None or rows <= most)


@dataclass(frozen=True)
class RowRoutes:
    """The picks of a model's products: ``prompts``, one per ``PROMPT_BUCKETS``; ``decode``."""

    prompts: tuple[str, ...]
    decode: str

    @classmethod
    def everywhere(cls, pick: str, decode: str | None = None) -> "RowRoutes":
        return cls((pick,) * len(PROMPT_BUCKETS), decode or pick)

    @classmethod
    def of(cls, picks: dict[str, str], decode: str) -> "RowRoutes":
        """From the choice's picks (its keys, ``PROMPT_KEYS`` and 'decode'; ``decode`` where it has none)."""
        return cls(tuple(picks.get(key, "native") for key in PROMPT_KEYS), picks.get("decode", decode))

    def pick(self, x: torch.Tensor) -> str:
        """The route of a product with input ``x`` [..., K]: by its class, and a prompt's by its rows."""
        rows = x.numel() // x.shape[-1]
        if rows <= DECODE_MOST and not prompt_shaped(x):
            return self.decode
        return self.prompts[bucket_of(rows)]

    def uses(self, pick: str) -> bool:
        return pick in self.prompts or pick == self.decode

    def integer_prompts(self) -> bool:
        return all(p == "integer" for p in self.prompts)


class RoutedWide:
    """The widened products of a quantized module where its routes pick them: ``takes(x)`` is what
    ``quantize.routed_product`` asks (before its kernel), the products are the shared
    ``WidenedProducts``' (one scratch for every layer)."""

    def __init__(self, products: WidenedProducts, routes: RowRoutes):
        self.products, self.routes = products, routes

    def takes(self, x: torch.Tensor) -> bool:
        return self.routes.pick(x) == "widened"

    def linear(self, *args, **kwargs) -> torch.Tensor:
        return self.products.linear(*args, **kwargs)

    def quantized(self, *args, **kwargs) -> torch.Tensor:
        return self.products.quantized(*args, **kwargs)


def is_quantized(module: nn.Module) -> bool:
    return getattr(module, "quantized", False)


def set_routes(module: nn.Module, routes: RowRoutes, wide, block_kernel: Callable | None) -> None:
    """``routes`` on ``module``: a float linear or head reads them at each product (``layers.py``);
    a quantized one takes integer products where they are picked and a ``RoutedWide`` where
    widened ones are (``wide``: a ``WidenedProducts``, or a ``RoutedWide`` to share)."""
    if is_quantized(module):
        set_integer(module, prompts=routes.integer_prompts(), decode=routes.decode == "integer",
                    block_kernel=block_kernel)
        if routes.uses("widened"):
            module.wide = wide if isinstance(wide, RoutedWide) else RoutedWide(wide, routes)
        else:
            module.__dict__.pop("wide", None)
    else:
        module.routes = routes
        if routes.uses("widened"):
            module.wide = wide
        else:
            module.__dict__.pop("wide", None)


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
    for name in ("wide", "block_kernel", "routes"):
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


def candidates(proxies: list[nn.Module], dtype: torch.dtype, keys: dict[str, list[str]], wide,
               block_kernel: Callable | None) -> dict[str, dict[str, Callable[[], float]]]:
    """The timers of the candidates of each key of the choice (``PROMPT_KEYS``, 'decode'): a
    prompt bucket's on one prompt of its timed rows, the decode's on ``DECODE_ROWS`` rows of one
    token each."""
    shapes = {key: [(1, rows)] for key, (_, rows) in zip(PROMPT_KEYS, PROMPT_BUCKETS)}
    shapes["decode"] = [(rows, 1) for rows in DECODE_ROWS]

    def setting(key: str, pick: str) -> Callable[[nn.Module], None]:
        picked = RowRoutes.everywhere("native", pick) if key == "decode" else RowRoutes.everywhere(pick, "native")
        return lambda proxy: set_routes(proxy, picked, wide, block_kernel)

    return {key: {pick: timer(proxies, shapes[key], dtype, setting(key, pick)) for pick in picks}
            for key, picks in keys.items()}


def describe_sample(proxies: list[nn.Module]) -> list:
    """What of the sampled products decides their timings, for the cache's name."""
    out = []
    for p in proxies:
        weight = p.qweight if is_quantized(p) else p.weight
        out.append([type(p).__name__, list(weight.shape), str(weight.dtype),
                    list(p.scales.shape) if is_quantized(p) else None, p.weight.shape[1]])
    return out

