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
from .quantize import QuantizeError, is_quantized_weight, prepare_quantized, stored_names, stored_quantization
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
    reader=None,
) -> tuple[StaticBloom, LoadReport]:
    """``adapter``: a LoRA adapter (``lora.read_adapter``) merged into the weights it targets, each
    rank merging its own slice, in fp32 before the cast to ``dtype``. ``reader``: where the tensors
    come from instead of the folder's weight files (the same methods as ``CheckpointReader``; the
    profiler's random weights drawn in memory); config.json is still the folder's."""
    start = time.perf_counter()
    folder = Path(folder)
    config = BloomConfig.from_json(folder / "config.json")
    check_splittable(config, parallel.world_size)
    stored = stored_quantization(config)
    quantized = stored is not None
    if quantized and adapter is not None:
        raise QuantizeError(f"--peft_weights merges an adapter into float weights; this checkpoint is stored "
                            f"{stored[0]} (merge into the float checkpoint, then quantize it)")
    with torch.device("meta"):
        model = StaticBloom(config, parallel)
    if quantized:
        prepare_quantized(model, dtype, group_size=stored[1])
    state = {}
    checkpoint_bytes = 0
    with (reader if reader is not None else CheckpointReader(folder)) as reader:
        if quantized:
            checkpoint_bytes += _load_quantized(model, reader, device, group_size=stored[1])
        for name, param in model.named_parameters():
            if quantized and is_quantized_weight(name):
                continue  # read quantized above
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


def _load_quantized(model: StaticBloom, reader: CheckpointReader, device, group_size: int | None) -> int:
    """Read a quantized checkpoint's weights and scales into the model's quantized modules, this
    rank's slice of each: int8 keeps every scale of a row-parallel slice (they are the whole rows');
    int4 packs two weights a byte and keeps a scale per group, so its columns slice by 2 and by G.
    Returns the bytes a single process would read."""
    total = 0
    for module_name, module in model.named_modules():
        if not getattr(module, "quantized", False) or "qweight" not in module._buffers:
            continue
        weight = f"{module_name}.weight"
        rows, cols = shard_slices(weight, model)
        qname, sname = stored_names(weight)
        want_q, want_scales = module.qweight, module.scales
        int4 = group_size is not None
        if int4:
            q = reader.get(qname, rows=rows, cols=_divided(cols, 2))
            scales = reader.get(sname, dtype=torch.float32, rows=rows, cols=_divided(cols, group_size))
        else:
            q = reader.get(qname, rows=rows, cols=cols)
            scales = reader.get(sname, dtype=torch.float32, rows=rows)
        if weight == "word_embeddings.weight" and q.shape[0] < want_q.shape[0]:  # the last rank's pad rows
            pad = want_q.shape[0] - q.shape[0]
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 0x88 if int4 else 0)])  # q = 0 either way
            scales = torch.cat([scales, scales.new_ones(pad, *scales.shape[1:])])
        if tuple(q.shape) != tuple(want_q.shape) or q.dtype != want_q.dtype \
                or tuple(scales.shape) != tuple(want_scales.shape):
            raise ValueError(f"checkpoint tensors {qname}, {sname} are {q.dtype} {tuple(q.shape)} and "
                             f"{tuple(scales.shape)}, the model expects {want_q.dtype} {tuple(want_q.shape)} and "
                             f"{tuple(want_scales.shape)}")
        module.register_buffer("qweight", q.to(device), persistent=False)
        module.register_buffer("scales", scales.to(device), persistent=False)
        total += _numel(reader.shape(qname)) * q.element_size() + 4 * _numel(reader.shape(sname))
    return total


def _divided(cols: slice | None, by: int) -> slice | None:
    """A slice of a weight's columns as a slice of a tensor holding one entry per ``by`` of them."""
    return None if cols is None else slice(cols.start // by, cols.stop // by)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
