"""Build a StaticBloom from a checkpoint folder, reading only this rank's slice of every weight.

The model is first built on the meta device (no memory), then each parameter is read straight from
the checkpoint into its final dtype and device. Under tensor parallelism every rank asks the reader
for its own rows or columns only, so its peak host memory is about its shard, not the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .alibi import alibi_slopes
from .checkpoint import CheckpointReader
from .config import BloomConfig
from .lora import LoraAdapter
from .model import StaticBloom
from .quantize import QuantizeError, check_stored_quantization, is_quantized_weight, prepare_int8, stored_names
from .tp import SINGLE, Parallel, check_splittable, shard_slices


@dataclass
class LoadReport:
    seconds: float
    bytes_read: int  # bytes this rank read from the checkpoint (its slices, in the stored dtype)
    checkpoint_bytes: int = 0  # bytes of every weight the model uses, as stored
    rank: int = 0
    world_size: int = 1

    def describe(self) -> str:
        """One line for the log, e.g. `rank 0/8: loaded in 41.2 s, read 45.1 GB of 352.1 GB (12.8%)`."""
        share = f" ({100 * self.bytes_read / self.checkpoint_bytes:.1f}%)" if self.checkpoint_bytes else ""
        who = f"rank {self.rank}/{self.world_size}: " if self.world_size > 1 else ""
        return (f"{who}loaded in {self.seconds:.2f} s, read {_human(self.bytes_read)} of "
                f"{_human(self.checkpoint_bytes)}{share}")


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    parallel: Parallel = SINGLE,
    adapter: LoraAdapter | None = None,
) -> tuple[StaticBloom, LoadReport]:
    """``adapter``: a LoRA adapter (``lora.read_adapter``) merged into the weights it targets, each
    rank merging its own slice, in fp32 before the cast to ``dtype``."""
    start = time.perf_counter()
    folder = Path(folder)
    config = BloomConfig.from_json(folder / "config.json")
    check_splittable(config, parallel.world_size)
    check_stored_quantization(config)
    quantized = config.quantization_config is not None
    if quantized and adapter is not None:
        raise QuantizeError("--peft_weights merges an adapter into float weights; this checkpoint is stored int8 "
                            "(merge into the float checkpoint, then quantize it)")
    with torch.device("meta"):
        model = StaticBloom(config, parallel)
    if quantized:
        prepare_int8(model, dtype)
    state = {}
    checkpoint_bytes = 0
    with CheckpointReader(folder) as reader:
        if quantized:
            checkpoint_bytes += _load_int8(model, reader, device)
        for name, param in model.named_parameters():
            if quantized and is_quantized_weight(name):
                continue  # read as int8 above
            rows, cols = shard_slices(name, model)
            if adapter is not None and name in adapter:
                tensor = adapter.merge(name, reader.get(name, dtype=torch.float32, rows=rows, cols=cols),
                                       rows, cols).to(dtype)
            else:
                tensor = reader.get(name, dtype=dtype, rows=rows, cols=cols)
            if name == "word_embeddings.weight" and tensor.shape[0] < param.shape[0]:
                # The last rank of a vocabulary that does not divide by the ranks: zero pad rows,
                # never looked up, their logits dropped after the gather (see tp.vocab_shard).
                tensor = torch.cat([tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0], *tensor.shape[1:])])
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(param.shape)} (config.json does not match the weights?)"
                )
            state[name] = tensor.to(device)
            # From the header only: what a single process would have read for this weight.
            checkpoint_bytes += _numel(reader.shape(name)) * reader.stored_dtype(name).itemsize
        bytes_read = reader.bytes_read
    model.load_state_dict(state, strict=False, assign=True)
    heads = model.local_heads
    model.slopes = alibi_slopes(config.n_head)[parallel.rank * heads : (parallel.rank + 1) * heads].to(device)
    model.eval().requires_grad_(False)
    report = LoadReport(time.perf_counter() - start, bytes_read, checkpoint_bytes, parallel.rank, parallel.world_size)
    return model, report


def _load_int8(model: StaticBloom, reader: CheckpointReader, device) -> int:
    """Read a quantized checkpoint's int8 weights and scales into the model's quantized modules,
    this rank's slice of each (a row-parallel slice keeps every scale: they are the whole rows').
    Returns the bytes a single process would read."""
    total = 0
    for module_name, module in model.named_modules():
        if not getattr(module, "quantized", False) or "qweight" not in module._buffers:
            continue
        weight = f"{module_name}.weight"
        rows, cols = shard_slices(weight, model)
        qname, sname = stored_names(weight)
        q = reader.get(qname, rows=rows, cols=cols)
        scales = reader.get(sname, dtype=torch.float32, rows=rows)
        want = tuple(module.qweight.shape)
        if weight == "word_embeddings.weight" and q.shape[0] < want[0]:  # the last rank's pad rows
            q = torch.cat([q, q.new_zeros(want[0] - q.shape[0], q.shape[1])])
            scales = torch.cat([scales, scales.new_ones(want[0] - scales.shape[0])])
        if tuple(q.shape) != want or q.dtype != torch.int8:
            raise ValueError(f"checkpoint tensor {qname} is {q.dtype} {tuple(q.shape)}, the model expects int8 {want}")
        module.register_buffer("qweight", q.to(device), persistent=False)
        module.register_buffer("scales", scales.to(device), persistent=False)
        total += _numel(reader.shape(qname)) + 4 * _numel(reader.shape(sname))
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
