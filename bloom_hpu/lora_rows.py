"""Many LoRA adapters in one batch, unmerged: each row of a step picks its own adapter.

The server runs rows of different adapters in one decode step. Merging is then impossible (one
weight per layer), so every targeted linear gets the adapters stacked beside its weight:

    A: [N+1, in, R]   B: [N+1, R, out]   (scale folded into B; index 0 = no adapter = zeros)

zero-padded to one rank R (the largest of any adapter), so that the step's shapes do not depend on
which adapters are in the batch. A row with adapter ``k`` gets ``y += (x @ A[k]) @ B[k]``, batched
over the rows with ``torch.bmm`` after a gather by the per-row index.

The index is one persistent tensor, ``AdapterRows.index`` [capacity] long, shared by every
targeted layer; a step over B rows reads ``index[:B]``. The engine writes it in place before each
step (``set``, ``move``, ``only``), so a captured graph, bound to that tensor, stays valid, and no
mix of adapters is a new step signature.

As with the CPU kernels (``runtime/cpu/layers.py``), this is a module swap applied to a finished
model: the model file stays BLOOM only. The swapped class adds the adapter term inside the layer's
``product``, so it composes with whatever product the runtime gave the layer (a CPU kernel,
oneDNN's packed weight), and for a row-parallel linear it lands before the all-reduce (each
rank's ``x_r @ A_r`` is a partial sum of ``x @ A``, like the product itself).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .lora import LoraAdapter
from .model import Linear, StaticBloom
from .runtime.transfer import host_to_device
from .tp import RowParallelLinear, shard_slices

DEFAULT_CAPACITY = 1024  # rows a step may have (the server's batch; an offline search's beams)


class AdapterRows:
    """Which adapter each row of the next step uses: ``index`` [capacity] long on the device (read
    by the layers), mirrored on the host (so no step waits for the device to learn it)."""

    def __init__(self, capacity: int, device: torch.device):
        self.index = torch.zeros(capacity, dtype=torch.long, device=device)
        self.host = [0] * capacity

    @property
    def capacity(self) -> int:
        return len(self.host)

    def set(self, row: int, adapter: int) -> None:
        self.set_each([row], [adapter])

    def set_many(self, rows: list[int], adapter: int) -> None:
        """``set`` for several rows, in one write."""
        self.set_each(rows, [adapter] * len(rows))

    def set_each(self, rows: list[int], adapters: list[int]) -> None:
        """Row ``rows[i]`` reads ``adapters[i]``, for every i, in one write."""
        for row, adapter in zip(rows, adapters):
            self.host[row] = adapter
        self._write_index()

    def _write_index(self) -> None:
        """The whole index from the host mirror: one op of one shape whatever the rows, written even
        when nothing changed (``index[row].fill_(adapter)`` is a view at a new offset and a new
        scalar each time, and a write made only sometimes changes the sequence of ops: lazy mode on
        a Gaudi would compile each variant anew)."""
        self.index.copy_(host_to_device(torch.tensor(self.host, dtype=torch.long), self.index.device))

    def move(self, src: int, dst: int) -> None:
        """The row in ``src`` now lives in ``dst`` (the engine compacting its rows)."""
        self.set(dst, self.host[src])

    @contextmanager
    def only(self, adapter: int):
        """Every row reads ``adapter`` inside the block (a request's own prefill, or a search of its
        own); the rows' adapters are put back after it."""
        self.index.fill_(adapter)
        try:
            yield
        finally:
            self._write_index()


@dataclass
class ServedAdapters:
    """The adapters a server serves: their names (index k + 1 in ``rows``) and folders, and the
    per-row index the engine writes."""

    names: dict[str, int]
    folders: dict[str, Path]
    rows: AdapterRows


class LoraProduct:
    """Mixed into a linear's class: its product plus each row's adapter term."""

    lora_a: torch.Tensor  # [N+1, in, R]
    lora_b: torch.Tensor  # [N+1, R, out], scale folded in
    rows: AdapterRows

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = super().product(x, bias)  # [B, T, out]
        index = self.rows.index[: x.shape[0]]  # [B]
        return out + torch.bmm(torch.bmm(x, self.lora_a[index]), self.lora_b[index])


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    """``cls`` with ``LoraProduct`` in front, made once per class (CpuLinear, Linear, ...)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraProduct, cls), {"unlora_class": cls})
    return _CLASSES[cls]


def stack(adapters: list[LoraAdapter], model: StaticBloom, capacity: int = DEFAULT_CAPACITY) -> AdapterRows:
    """Swap every linear of ``model`` that one of ``adapters`` targets for its per-row form
    (adapter k is index k + 1); returns the index the engine writes. The model's weights are
    untouched: index 0 everywhere is the base model."""
    param = model.ln_f.weight  # the activations' dtype and device
    rows = AdapterRows(capacity, param.device)
    rank = max(a.max_rank for a in adapters)
    for block_index, block in enumerate(model.h):
        for path in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                     "mlp.dense_4h_to_h"):
            name = f"h.{block_index}.{path}.weight"
            pairs = [a.pairs.get(name) for a in adapters]
            if not any(pairs):
                continue
            parent, attr = block.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
            linear = getattr(parent, attr)
            assert isinstance(linear, (Linear, RowParallelLinear)), type(linear)
            out_features, in_features = linear.out_features, linear.in_features
            a = torch.zeros(len(adapters) + 1, in_features, rank)
            b = torch.zeros(len(adapters) + 1, rank, out_features)
            row_slice, col_slice = shard_slices(name, model)  # this rank's part, as the weight
            for k, pair in enumerate(pairs, start=1):
                if pair is None:
                    continue
                pa = pair.a if col_slice is None else pair.a[:, col_slice]  # [r, in]
                pb = pair.b if row_slice is None else pair.b[row_slice]  # [out, r]
                a[k, :, : pair.rank] = pa.T
                b[k, : pair.rank, :] = pair.scale * pb.T
            if getattr(linear, "fused_gelu", False):
                # The CPU path computes GELU inside this product (runtime/cpu); the adapter term
                # must come before it, so the GELU goes back to the MLP.
                linear.fused_gelu = False
                block.mlp.gelu = nn.GELU(approximate="tanh")
            linear.__class__ = _lora_class(type(linear))
            linear.lora_a = a.to(device=param.device, dtype=param.dtype)
            linear.lora_b = b.to(device=param.device, dtype=param.dtype)
            linear.rows = rows
    return rows
