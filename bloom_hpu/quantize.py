"""Weight-only int8 quantization, applied to a finished model (as gpt-fast's ``quantize.py``).

Every linear layer, the word embeddings and the tied LM head keep their weight as int8 with one
scale per output row (symmetric: ``w ~= q * scale``, ``q`` in [-127, 127], ``scale = max|w| / 127``
over the whole row). Activations, the KV cache and the sums stay in the model's dtype. The model
file stays BLOOM: ``quantize_int8(model)`` swaps the classes of its modules in place, each keeping
its name, for ``QuantLinear`` / ``QuantRowParallelLinear`` / ``QuantEmbedding`` / ``QuantTiedHead``,
whose product multiplies by the int8 weight: ``torch._weight_int8pack_mm`` on the CPU (a public
ATen op made for this, reading int8 bytes), or, where the runtime says so (``dequantize_in_products``:
the HPU and CUDA backends), the weight dequantized inside the product with public ops only (no host
sync, no new shape, so HPU and CUDA graphs capture it).

Tensor parallelism: each rank holds a slice of every weight. A column-parallel slice holds whole
rows, so its scales are the rows' own; a row-parallel slice (attention dense, dense_4h_to_h) holds a
part of each row, so its row maxima are all-reduced (MAX) first: every rank then uses the scale of
the whole row, and two ranks give the tokens of one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import Linear, StaticBloom, TiedHead
from .tp import RowParallelLinear, VocabParallelEmbedding

MODES = ("int8",)
QMAX = 127
# ``quantization_config`` of a checkpoint saved quantized (utils/quantize_checkpoint.py): weight W of
# a linear layer or the embeddings is stored as ``W's module.qweight`` (int8) and ``.scales`` (fp32).
QUANTIZATION_CONFIG = {"quant_method": "bloom_hpu", "bits": 8, "scales": "per_output_row", "symmetric": True}
_QUANTIZED_MODULES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


class QuantizeError(ValueError):
    """A quantization the model or the device cannot run (one line for the user)."""


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


def check_stored_quantization(config) -> None:
    """A checkpoint quantized in a format of ours, or none; anything else is one clear error."""
    stored = config.quantization_config
    if stored is None:
        return
    if not isinstance(stored, dict) or stored.get("quant_method") != QUANTIZATION_CONFIG["quant_method"] \
            or stored.get("bits") != QUANTIZATION_CONFIG["bits"]:
        method = stored.get("quant_method") if isinstance(stored, dict) else stored
        raise QuantizeError(f"the checkpoint is quantized as {method!r}, which this program does not read; "
                            "give it the float weights (utils/quantize_checkpoint.py makes int8 ones it reads)")


def row_scales(weight: torch.Tensor, parallel=None, split_rows: bool = False) -> torch.Tensor:
    """[N] float32 scales of a [N, K] weight: max|w| / 127 per row, over the whole row under tensor
    parallelism (``split_rows``: this rank holds a part of each row)."""
    peak = weight.detach().float().abs().amax(dim=1)
    if split_rows and parallel is not None and parallel.world_size > 1:
        peak = peak.to(getattr(parallel, "device", "cpu"))
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        peak = peak.to(weight.device)
    return (peak / QMAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_rows(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.round(weight.detach().float() / scales[:, None]).clamp(-QMAX, QMAX).to(torch.int8)


def dequantized(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` computed in fp32, then cast: the weights transformers is checked against."""
    return (q.float() * scales[:, None]).to(dtype)


# Which CPU product serves how many rows (measured on bloom-560m's weights, 2 Zen 4 cores; the
# runtime picks, runtime/cpu/accelerate.int8_kernel_rows): our kernel reads the int8 weight at
# memory speed for 1-2 rows. With bf16 inputs on the AVX-512 build it widens each weight once into
# VDPBF16PS products, and on the AVX2 build its sums fit the registers: both stay faster than
# torch._weight_int8pack_mm up to 64 rows (INT8_KERNEL_MANY_ROWS; fewer where AMX gives oneDNN's
# bf16 products of many rows the edge, as for bf16 weights). With fp32/fp16 inputs on the AVX-512
# build it serves 1-2 rows and torch._weight_int8pack_mm the next ones. Past 64 rows (a long
# prefill, a scoring pass) dequantizing the weight in the product and multiplying through oneDNN wins.
INT8_KERNEL_ROWS = 2
INT8_KERNEL_MANY_ROWS = 64
INT8_MM_ROWS = 64


def int8_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, int8_mm: bool = True) -> torch.Tensor:
    """x [..., K] @ (q [N, K] * scales [N]).T in x's dtype; ``int8_mm``: through
    ``torch._weight_int8pack_mm`` (the CPU's) for a few rows, else dequantized in the product.

    Dequantized, the scales multiply the product's columns rather than the weight, as the kernels
    do (``(x @ q.T) * scales``, the same sum): the int8 weight is widened to x's dtype (every int8
    value is exact there) and nothing else of the weight's size is written or read again."""
    if int8_mm and x.numel() <= INT8_MM_ROWS * x.shape[-1]:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return torch._weight_int8pack_mm(flat, q, scales.to(x.dtype)).view(*x.shape[:-1], q.shape[0])
    return F.linear(x, q.to(x.dtype)) * scales.to(x.dtype)


def routed_int8_product(module, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """The product of a quantized ``module`` (a linear, or the tied head) as its runtime routes it:
    the CPU runtime's int8 kernel for the rows it serves, else ``int8_product``."""
    if module.int8_kernel is not None and x.numel() <= module.int8_kernel_rows * x.shape[-1]:
        return module.int8_kernel(x, q, scales, bias)
    out = int8_product(x, q, scales, module.int8_mm)
    return out if bias is None else out + bias


class _QuantProduct:
    """``product`` of the model's linears over the int8 weight (``qweight`` [N, K], ``scales`` [N])."""

    quantized = True
    int8_mm = True  # False: dequantize in the product (set by the runtime, see dequantize_in_products)
    int8_kernel = None  # the CPU runtime's own int8 product of a few rows, when it has one
    int8_kernel_rows = INT8_KERNEL_ROWS  # the most rows it serves (set with it)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return routed_int8_product(self, x, self.qweight, self.scales, bias)


class QuantLinear(_QuantProduct, Linear):
    pass


class QuantRowParallelLinear(_QuantProduct, RowParallelLinear):
    pass


class QuantEmbedding(VocabParallelEmbedding):
    """Rows of the int8 embeddings, scaled back into the model's dtype."""

    quantized = True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return (F.embedding(ids, self.qweight).to(self.scales.dtype) * self.scales[ids][..., None]).to(self.dtype)

    def forward(self, ids):
        if self.parallel.world_size == 1:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        return self.parallel.all_reduce(self._lookup(local).masked_fill(outside[..., None], 0.0))


class QuantTiedHead(TiedHead):
    """The LM head over the embeddings' int8 rows (its ``weight`` argument is not read)."""

    quantized = True
    int8_mm = True
    int8_kernel = None
    int8_kernel_rows = INT8_KERNEL_ROWS

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return routed_int8_product(self, x, self.embeddings.qweight, self.embeddings.scales, None)


_CLASSES = {Linear: QuantLinear, RowParallelLinear: QuantRowParallelLinear}


def _swap(module: nn.Module, cls: type, split_rows: bool, parallel) -> None:
    scales = row_scales(module.weight, parallel, split_rows)
    module.register_buffer("qweight", quantize_rows(module.weight, scales), persistent=False)
    module.register_buffer("scales", scales, persistent=False)
    module.dtype = module.weight.dtype
    # The float weight goes (a meta tensor keeps its shape and dtype for whoever asks).
    module.weight = nn.Parameter(module.weight.detach().to("meta"), requires_grad=False)
    module.__class__ = cls


def prepare_int8(model: StaticBloom, dtype: torch.dtype) -> None:
    """Give a model built on the meta device the int8 layout, for a quantized checkpoint's tensors
    to be loaded into (``loading.py``): every quantized module gets empty ``qweight`` / ``scales``
    buffers of its weight's (this rank's) shape."""
    for module in list(model.modules()):
        cls = _CLASSES.get(type(module))
        if cls is None and module is model.word_embeddings:
            cls = QuantEmbedding
        if cls is None:
            continue
        rows, cols = module.weight.shape
        module.register_buffer("qweight", torch.empty(rows, cols, dtype=torch.int8, device="meta"), persistent=False)
        module.register_buffer("scales", torch.empty(rows, dtype=torch.float32, device="meta"), persistent=False)
        module.dtype = dtype
        module.__class__ = cls
    model.head.__class__ = QuantTiedHead
    model.head.embeddings = model.word_embeddings


def quantize_int8(model: StaticBloom) -> StaticBloom:
    """Quantize ``model``'s weights to int8 in place (see the module doc); returns it."""
    if any(getattr(m, "quantized", False) for m in model.modules()):
        raise QuantizeError("the model is quantized already")
    parallel = model.parallel
    for module in list(model.modules()):
        cls = _CLASSES.get(type(module))
        if cls is not None:
            _swap(module, cls, split_rows=isinstance(module, RowParallelLinear), parallel=parallel)
    _swap(model.word_embeddings, QuantEmbedding, split_rows=False, parallel=parallel)
    model.head.__class__ = QuantTiedHead
    model.head.embeddings = model.word_embeddings
    return model


def dequantize_in_products(model: nn.Module) -> None:
    """The runtime's choice for a card (HPU, CUDA): quantized products dequantize their weight with
    public ops instead of calling the CPU's int8 kernel."""
    for module in model.modules():
        if getattr(module, "quantized", False) and hasattr(module, "int8_mm"):
            module.int8_mm = False


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights the model holds in memory (int8 weights and their scales as such)."""
    tensors = list(model.parameters()) + [b for name, b in model.named_buffers()
                                          if name.endswith((".qweight", ".scales"))]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
