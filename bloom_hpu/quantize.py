"""Weight-only quantization (int8, int4), applied to a finished model (as gpt-fast's ``quantize.py``).

Every linear layer, the word embeddings and the tied LM head keep their weight quantized:

* int8: one scale per output row (symmetric: ``w ~= q * scale``, ``q`` in [-127, 127],
  ``scale = max|w| / 127`` over the whole row);
* int4: one scale per group of G weights of a row, packed two to a byte (``int4.py``).

Activations, the KV cache and the sums stay in the model's dtype. The model file stays BLOOM:
``quantize(model, mode)`` swaps the classes of its modules in place, each keeping its name, for
``QuantLinear`` / ``QuantRowParallelLinear`` / ``QuantEmbedding`` / ``QuantTiedHead``, which hold
``qweight`` and ``scales`` and multiply by them: through the CPU runtime's kernels where it set
them (``runtime/cpu/accelerate.py``), else int8 through ``torch._weight_int8pack_mm`` on the CPU (a
public ATen op made for this, reading int8 bytes) and int4 dequantized inside the product; where
the runtime says so (``dequantize_in_products``: the HPU and CUDA backends) both dequantize with
public ops only (no host sync, no new shape, so HPU and CUDA graphs capture them).

Tensor parallelism: each rank holds a slice of every weight. A column-parallel slice holds whole
rows, so its scales are the rows' own; a row-parallel slice (attention dense, dense_4h_to_h) holds a
part of each row, so for int8 its row maxima are all-reduced (MAX) first: every rank then uses the
scale of the whole row. int4's groups lie within a rank's part (the group size must divide it).
Either way two ranks give the tokens of one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import int4
from .int8_activations import NEEDS_QUANTIZED, Int8ActivationsError, block_product, check_rows, takes_integer
from .int4 import DEFAULT_GROUP_SIZE, GroupSizeError, check_group_size, dequantized_int4, int4_product
from .model import Linear, StaticBloom, TiedHead
from .tp import RowParallelLinear, VocabParallelEmbedding

MODES = ("int8", "int4")
QMAX = 127
_QUANTIZED_MODULES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


class QuantizeError(ValueError):
    """A quantization the model or the device cannot run (one line for the user)."""


def quantization_config(mode: str, group_size: int | None = None) -> dict:
    """``quantization_config`` of a checkpoint saved quantized (utils/quantize_checkpoint.py): weight
    W of a linear layer or the embeddings is stored as ``W's module.qweight`` (int8 [N, K], or int4
    packed in uint8 [N, K / 2]) and ``.scales`` (fp32 [N], or [N, K / group_size])."""
    if mode == "int8":
        return {"quant_method": "bloom_hpu", "bits": 8, "scales": "per_output_row", "symmetric": True}
    return {"quant_method": "bloom_hpu", "bits": 4, "group_size": group_size, "scales": "per_group",
            "symmetric": True, "packing": "two per byte, weights j and j+16 of each block of 32"}


def resolve_group_size(mode: str | None, group_size: int | None) -> int | None:
    """int4's group size (the default where none is given); None for int8 (which has no groups)."""
    if mode == "int4":
        return DEFAULT_GROUP_SIZE if group_size is None else group_size
    if group_size is not None:
        raise QuantizeError("a group size goes with int4 quantization (--quantize int4)")
    return None


def is_quantized_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` (unprefixed) is one that int8 keeps quantized."""
    if name == "word_embeddings.weight":
        return True
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in _QUANTIZED_MODULES


def stored_names(name: str) -> list[str]:
    """The names a quantized checkpoint stores weight ``name`` under."""
    module = name.removesuffix(".weight")
    return [f"{module}.qweight", f"{module}.scales"]


def stored_quantization(config) -> tuple[str, int | None] | None:
    """(mode, group size) of a checkpoint quantized in a format of ours, None for float weights;
    anything else is one clear error."""
    stored = config.quantization_config
    if stored is None:
        return None
    method = stored.get("quant_method") if isinstance(stored, dict) else stored
    if method != "bloom_hpu" or stored.get("bits") not in (8, 4):
        raise QuantizeError(f"the checkpoint is quantized as {method!r}, which this program does not read; "
                            "give it the float weights (utils/quantize_checkpoint.py makes int8 and int4 ones "
                            "it reads)")
    if stored["bits"] == 8:
        return "int8", None
    group_size = stored.get("group_size")
    if group_size not in int4.GROUP_SIZES:
        raise QuantizeError(f"the checkpoint's int4 group size {group_size!r} is not one of "
                            f"{', '.join(map(str, int4.GROUP_SIZES))}")
    return "int4", group_size


def row_scales(weight: torch.Tensor, parallel=None, split_rows: bool = False) -> torch.Tensor:
    """[N] float32 scales of a [N, K] weight: max|w| / 127 per row, over the whole row under tensor
    parallelism (``split_rows``: this rank holds a part of each row)."""
    peak = weight.detach().float().abs().amax(dim=1)
    if split_rows and parallel is not None and parallel.world_size > 1:
        peak = peak.to(getattr(parallel, "device", "cpu"))
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=getattr(parallel, "group", None))
        peak = peak.to(weight.device)
    return (peak / QMAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_rows(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.round(weight.detach().float() / scales[:, None]).clamp(-QMAX, QMAX).to(torch.int8)


def dequantized(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` computed in fp32, then cast: the weights transformers is checked against."""
    return (q.float() * scales[:, None]).to(dtype)


# Which CPU product serves how many rows (bench/cpu_products_bench.py compares them; the runtime
# picks, runtime/cpu/accelerate.quantized_kernel_rows): our kernel reads the int8 weight at
# memory speed for 1-2 rows. With bf16 inputs on the AVX-512 build it widens each weight once into
# VDPBF16PS products, and on the AVX2 build its sums fit the registers: both stay faster than
# torch._weight_int8pack_mm up to 64 rows (INT8_KERNEL_MANY_ROWS; fewer where AMX gives oneDNN's
# bf16 products of many rows the edge, as for bf16 weights). With fp32/fp16 inputs on the AVX-512
# build it serves up to 32 rows (INT8_KERNEL_FLOAT_ROWS); torch._weight_int8pack_mm takes only bf16
# inputs here, as with fp32 or fp16 ones it is slower than the dequantized product even at one row
# (torch 2.13: about 3 ms per row for a 4096 x 1024 weight on 2 cores). Past those rows (a long
# prefill, a scoring pass) dequantizing the weight in the product and multiplying through oneDNN
# wins, except where the kernels' AMX tiles are on: there the kernel serves every row, from 8 rows
# on the tiles, widening the weight a strip at a time (runtime/cpu/csrc/amx_rows.h).
INT8_KERNEL_ROWS = 2
INT8_KERNEL_MANY_ROWS = 64
INT8_KERNEL_FLOAT_ROWS = 32
INT8_MM_ROWS = 64


def int8_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, int8_mm: bool = True) -> torch.Tensor:
    """x [..., K] @ (q [N, K] * scales [N]).T in x's dtype; ``int8_mm``: through
    ``torch._weight_int8pack_mm`` (the CPU's) for a few rows of bf16, else dequantized in the product.

    Dequantized, the scales multiply the product's columns rather than the weight, as the kernels
    do (``(x @ q.T) * scales``, the same sum): the int8 weight is widened to x's dtype (every int8
    value is exact there) and nothing else of the weight's size is written or read again."""
    if int8_mm and x.dtype == torch.bfloat16 and x.numel() <= INT8_MM_ROWS * x.shape[-1]:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return torch._weight_int8pack_mm(flat, q, scales.to(x.dtype)).view(*x.shape[:-1], q.shape[0])
    return F.linear(x, q.to(x.dtype)) * scales.to(x.dtype)


def routed_product(module, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The product of a quantized ``module`` (a linear, or the tied head) as its runtime routes it:
    with integer products (``takes_integer``), the CPU runtime's integer kernel or else their
    public-op form; else its fp32 product on the widened weight where its routes pick it (``wide``,
    runtime/cpu/routes.py), else its kernel for the rows it serves, else ``int8_product`` /
    ``int4_product``."""
    if takes_integer(module, x):
        return (module.block_kernel or block_product)(x, q, scales, bias)
    if module.wide is not None and module.wide.takes(x):
        return module.wide.quantized(x, q, scales, bias)
    if module.kernel is not None and x.numel() <= module.kernel_rows * x.shape[-1]:
        return module.kernel(x, q, scales, bias)
    if q.dtype == torch.uint8:  # int4, packed
        out = int4_product(x, q, scales, module.int4_dequantize)
    else:
        out = int8_product(x, q, scales, module.int8_mm)
    return out if bias is None else out + bias


class _QuantProduct:
    """``product`` of the model's linears over the quantized weight: int8 ``qweight`` [N, K] with
    ``scales`` [N], or int4 ``qweight`` uint8 [N, K / 2] with ``scales`` [N, K / G]."""

    quantized = True
    int8_mm = True  # int8: False dequantizes in the product (set by the runtime, see dequantize_in_products)
    int4_dequantize = None  # int4: the CPU runtime's dequantization into its scratch memory, when it has one
    kernel = None  # the CPU runtime's own product of a few rows, when it has one
    kernel_rows = INT8_KERNEL_ROWS  # the most rows it serves (set with it)
    wide = None  # the CPU runtime's fp32 products where its routes pick them (runtime/cpu/routes.RoutedWide), if any
    int8_activations = False  # integer products: the input rounded per block of 32 (int8_activations.py)
    integer_prompts = integer_decode = True  # with them, for which products (the CPU runtime's choice)
    block_kernel = None  # with them, the CPU runtime's integer kernel, when it has one

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return routed_product(self, x, self.qweight, self.scales, bias)


class QuantLinear(_QuantProduct, Linear):
    pass


class QuantRowParallelLinear(_QuantProduct, RowParallelLinear):
    pass


class QuantEmbedding(VocabParallelEmbedding):
    """Rows of the quantized embeddings, dequantized into the model's dtype."""

    quantized = True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight.dtype == torch.uint8:  # int4: the rows' packed bytes and group scales
            flat = ids.reshape(-1)
            rows = dequantized_int4(F.embedding(flat, self.qweight), self.scales[flat], self.dtype)
            return rows.view(*ids.shape, rows.shape[-1])
        return (F.embedding(ids, self.qweight).to(self.scales.dtype) * self.scales[ids][..., None]).to(self.dtype)

    def forward(self, ids):
        if self.parallel.world_size == 1:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        return self.parallel.all_reduce(self._lookup(local).masked_fill(outside[..., None], 0.0))


class QuantTiedHead(_QuantProduct, TiedHead):
    """The LM head over the embeddings' quantized rows (its ``weight`` argument is not read)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return routed_product(self, x, self.embeddings.qweight, self.embeddings.scales, None)


_CLASSES = {Linear: QuantLinear, RowParallelLinear: QuantRowParallelLinear}


def _quantized_modules(model: StaticBloom) -> list[tuple[nn.Module, type]]:
    """Every module whose weight is quantized, with the class it becomes."""
    pairs = [(m, _CLASSES[type(m)]) for m in model.modules() if type(m) in _CLASSES]
    return pairs + [(model.word_embeddings, QuantEmbedding)]


def _check_groups(model: StaticBloom, group_size: int) -> None:
    rows = {name: module.weight.shape[1] for name, module in model.named_modules()
            if type(module) in _CLASSES or module is model.word_embeddings}
    try:
        check_group_size(group_size, rows)
    except GroupSizeError as error:
        world = model.parallel.world_size
        raise QuantizeError(f"{error}{f' (each of {world} ranks holds a part of a row)' if world > 1 else ''}") \
            from None


def quantize_weight(weight: torch.Tensor, group_size: int | None = None, parallel=None,
                    split_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) of a float weight [N, K]: int8 with a scale per row (``split_rows``: this
    rank holds a part of each row, see ``row_scales``), or int4 with a scale per ``group_size``
    weights (a group lies within this rank's part of a row: its scale is the whole model's)."""
    if group_size is None:
        scales = row_scales(weight, parallel, split_rows)
        return quantize_rows(weight, scales), scales
    scales = int4.group_scales(weight, group_size)
    return int4.quantize_groups(weight, scales), scales


def _swap(module: nn.Module, cls: type, split_rows: bool, parallel, group_size: int | None) -> None:
    qweight, scales = quantize_weight(module.weight, group_size, parallel, split_rows)
    module.register_buffer("qweight", qweight, persistent=False)
    module.register_buffer("scales", scales, persistent=False)
    module.dtype = module.weight.dtype
    # The float weight goes (a meta tensor keeps its shape and dtype for whoever asks).
    module.weight = nn.Parameter(module.weight.detach().to("meta"), requires_grad=False)
    module.__class__ = cls


def _tie_head(model: StaticBloom) -> None:
    model.head.__class__ = QuantTiedHead
    model.head.embeddings = model.word_embeddings


def prepare_quantized(model: StaticBloom, dtype: torch.dtype, group_size: int | None = None) -> None:
    """Give a model built on the meta device the quantized layout (int8, or int4 with
    ``group_size``), for a quantized checkpoint's tensors to be loaded into (``loading.py``): every
    quantized module gets empty ``qweight`` / ``scales`` buffers of its weight's (this rank's) shape."""
    if group_size is not None:
        _check_groups(model, group_size)
    for module, cls in _quantized_modules(model):
        rows, cols = module.weight.shape
        if group_size is None:
            q, scales = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows)
        else:
            q, scales = torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(rows, cols // group_size)
        module.register_buffer("qweight", q.to("meta"), persistent=False)
        module.register_buffer("scales", scales.to("meta"), persistent=False)
        module.dtype = dtype
        module.__class__ = cls
    _tie_head(model)


def quantize(model: StaticBloom, mode: str = "int8", group_size: int | None = None) -> StaticBloom:
    """Quantize ``model``'s weights in place (see the module doc): ``mode`` "int8", or "int4" with
    ``group_size`` weights per scale (default ``int4.DEFAULT_GROUP_SIZE``); returns the model."""
    if mode not in MODES:
        raise QuantizeError(f"unknown quantization {mode!r}: choose {', '.join(MODES)}")
    group_size = resolve_group_size(mode, group_size)
    if any(getattr(m, "quantized", False) for m in model.modules()):
        raise QuantizeError("the model is quantized already")
    if group_size is not None:
        _check_groups(model, group_size)
    for module, cls in _quantized_modules(model):
        _swap(module, cls, split_rows=isinstance(module, RowParallelLinear), parallel=model.parallel,
              group_size=group_size)
    _tie_head(model)
    return model


def dequantize_in_products(model: nn.Module) -> None:
    """The runtime's choice for a card (HPU, CUDA): quantized products dequantize their weight with
    public ops instead of calling the CPU's int8 op (int4 does so already)."""
    for module in model.modules():
        if getattr(module, "quantized", False) and hasattr(module, "int8_mm"):
            module.int8_mm = False


def use_int8_activations(model: StaticBloom) -> None:
    """Integer products for every quantized product of ``model`` (``int8_activations.py``): their
    input rounded to int8 per block of 32 values. Raises ``Int8ActivationsError`` for a model
    that is not quantized or whose rows are not whole blocks."""
    products = quantized_products(model)
    if not products:
        raise Int8ActivationsError(NEEDS_QUANTIZED)
    check_rows(products, model.parallel.world_size)
    for module in products:
        module.int8_activations = True


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights the model holds in memory (quantized weights and their scales as such)."""
    tensors = list(model.parameters()) + [b for name, b in model.named_buffers()
                                          if name.endswith((".qweight", ".scales"))]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def quantized_products(model: nn.Module) -> list[nn.Module]:
    """The modules whose product multiplies by a quantized weight (the linears and the LM head)."""
    return [m for m in model.modules() if isinstance(m, _QuantProduct)]


def quantized_mode(model: StaticBloom) -> str | None:
    """"int8" or "int4" where ``model``'s weights are quantized, else None."""
    q = getattr(model.word_embeddings, "qweight", None)
    return None if q is None else "int4" if q.dtype == torch.uint8 else "int8"
