"""The preallocated key/value cache, written in place.

One cache is allocated per (batch, length) shape and reused by every call of that shape, so its
storage never moves: captured graphs can keep pointing at it. Nothing ever grows it with
``torch.cat``. It comes in two layouts, chosen by the backend (``Backend.per_layer_cache``):

* **stacked** (CPU, CUDA): ``keys`` and ``values`` are one contiguous [n_layer, B, H, K, D] tensor
  each. The CPU's one-call kernels read them whole (the decode step takes the 5-D tensors) or a
  layer at a time (``keys[layer]``, a contiguous [B, H, K, D] view). Writes go through views of a
  layer (``narrow().copy_``, indexed assignment): the cheapest on a CPU, and CUDA graphs do not
  mind views.
* **per layer** (HPU): one tensor per layer, each allocated on its own as a flat [B*H*K, D] and
  written whole with ``index_copy_`` (prefill and decode alike). HPU graphs do not support in-place
  writes into views; this is how Habana's own BLOOM updates its cache. ``keys[layer]`` is the same
  [B, H, K, D] view of it for reading.

Either way ``keys[layer]`` / ``values[layer]`` read a layer as [B, H, K, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .alibi import alibi_bias
from .runtime.transfer import host_to_device


@dataclass
class KVCache:
    keys: torch.Tensor | tuple[torch.Tensor, ...]  # stacked: [n_layer, B, H, K, D]; per layer: n_layer x [B, H, K, D]
    values: torch.Tensor | tuple[torch.Tensor, ...]
    alibi: torch.Tensor  # [B * H, 1, K]: slope[h] * slot, precomputed once
    # Index vectors the decode step needs every time, made once (an arange costs as much as a
    # small matmul on CPU, and a captured graph may keep pointing at these): [B] rows, [K] slots.
    rows: torch.Tensor  # [B] 0..B-1
    slots: torch.Tensor  # [K] 0..K-1
    # Per layer only: each layer's own flat [B*H*K, D] tensors (``keys[layer]`` views them), and
    # the flat row of slot 0 of each (row, head) [B, H].
    flat_keys: tuple[torch.Tensor, ...] = ()
    flat_values: tuple[torch.Tensor, ...] = ()
    row_heads: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        n_layer: int,
        batch_size: int,
        n_head: int,
        length: int,
        head_dim: int,
        slopes: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | str,
        per_layer: bool = False,
    ) -> "KVCache":
        rows = torch.arange(batch_size, device=device)
        slots = torch.arange(length, device=device)
        alibi = alibi_bias(slopes.to(device), length, batch_size, dtype)
        # Zeros, not empty: unwritten slots are masked, but 0 * NaN garbage would still poison
        # the attention-weighted sum of values.
        if not per_layer:
            shape = (n_layer, batch_size, n_head, length, head_dim)
            keys = torch.zeros(shape, dtype=dtype, device=device)
            values = torch.zeros(shape, dtype=dtype, device=device)
            return cls(keys, values, alibi, rows, slots)
        flat = (batch_size * n_head * length, head_dim)
        flat_keys = tuple(torch.zeros(flat, dtype=dtype, device=device) for _ in range(n_layer))
        flat_values = tuple(torch.zeros(flat, dtype=dtype, device=device) for _ in range(n_layer))
        layer = (batch_size, n_head, length, head_dim)
        row_heads = torch.arange(batch_size * n_head, device=device).view(batch_size, n_head) * length
        return cls(tuple(t.view(layer) for t in flat_keys), tuple(t.view(layer) for t in flat_values),
                   alibi, rows, slots, flat_keys, flat_values, row_heads)

    @property
    def per_layer(self) -> bool:
        return bool(self.flat_keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def write_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prefill's keys/values [B, H, P, D] in slots 0..P-1 (P is a static shape)."""
        prompt_len = k.shape[2]
        if self.per_layer:
            where = self.prefix_rows(prompt_len)
            self.flat_keys[layer].index_copy_(0, where, k.reshape(-1, k.shape[-1]))
            self.flat_values[layer].index_copy_(0, where, v.reshape(-1, v.shape[-1]))
            return
        self.keys[layer].narrow(2, 0, prompt_len).copy_(k)
        self.values[layer].narrow(2, 0, prompt_len).copy_(v)

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one new token's keys/values [B, H, 1, D] at each row's own slot ``positions`` [B]."""
        if self.per_layer:
            # Row (b, h, positions[b]) of the flat layer, for every b and h: [B*H].
            where = (self.row_heads + positions[:, None]).view(-1)
            self.flat_keys[layer].index_copy_(0, where, k.reshape(-1, k.shape[-1]))
            self.flat_values[layer].index_copy_(0, where, v.reshape(-1, v.shape[-1]))
            return
        # Indexed assignment (index_put_) writes just the B*H*D new values. Not ``scatter_``: on CPU
        # in bf16 it copies the whole layer of the cache twice per call, a cost that grows with the
        # cache's length and comes twice per layer of every decode step.
        self.keys[layer][self.rows, :, positions] = k[:, :, 0]  # [B, H, D] at (row, all heads, slot)
        self.values[layer][self.rows, :, positions] = v[:, :, 0]

    def write_span(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store S prompt segments' keys/values [S, H, C, D]: segment s in row ``rows[s]`` at
        ``slots[s]`` [S, C] (prompts continued inside a decode step: ``StaticBloom.mixed``). Rows
        and slots are device tensors, so any row and offset is the same op."""
        if self.per_layer:
            # Flat row of (rows[s], head h, slots[s, c]) for every s, h, c: [S*H*C].
            where = (self.row_heads.index_select(0, rows)[:, :, None] + slots[:, None, :]).reshape(-1)
            self.flat_keys[layer].index_copy_(0, where, k.reshape(-1, k.shape[-1]))
            self.flat_values[layer].index_copy_(0, where, v.reshape(-1, v.shape[-1]))
            return
        # (row s, all heads, slot c) for every (s, c): indexed assignment of [S, C, H, D].
        self.keys[layer][rows[:, None], :, slots] = k.transpose(1, 2)
        self.values[layer][rows[:, None], :, slots] = v.transpose(1, 2)

    def row_window(self, layer: int, rows: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [S, H, window, D] of the first ``window`` slots of rows ``rows`` [S]."""
        return (self.keys[layer][:, :, :window].index_select(0, rows),
                self.values[layer][:, :, :window].index_select(0, rows))

    def prefix_rows(self, prompt_len: int) -> torch.Tensor:
        """Flat rows of slots 0..P-1 of every (row, head), [B*H*P]. Computed where it is used (two
        small operations, inside the captured step), so no tensor made during a capture outlives it."""
        return (self.row_heads[:, :, None] + self.slots[None, None, :prompt_len]).reshape(-1)

    def copy_prompts(self, prompts: "KVCache", copies: int) -> None:
        """Rows c*i .. c*i+c-1 (c = ``copies``) take the slots of row i of ``prompts``, a cache of
        B rows as long as the prompt: beams and sampled copies of a prompt share its one prefill."""
        b, length = prompts.batch_size, prompts.length
        if self.per_layer:
            where = self.prefix_rows(length)
            for mine, theirs in zip(self.flat_keys + self.flat_values, prompts.keys + prompts.values):
                mine.index_copy_(0, where, theirs.repeat_interleave(copies, dim=0).reshape(-1, theirs.shape[-1]))
            return
        for mine, theirs in ((self.keys, prompts.keys), (self.values, prompts.values)):
            # [n_layer, B*c, H, P, D] seen as [n_layer, B, c, H, P, D]; theirs broadcast over c.
            mine[:, :, :, :length].unflatten(1, (b, copies)).copy_(theirs[:, :, None])

    def copy_rows(self, source: "KVCache", src_rows: list[int], dst_rows: list[int], extent: int) -> None:
        """Row ``dst_rows[i]`` takes the first ``extent`` slots of row ``src_rows[i]`` of ``source``
        (a cache of the same length and heads; it may be this one). What the server's engine uses
        to move prompts and running rows between its caches. Per layer, whole-tensor index ops of
        whole rows: the row numbers travel as one index tensor, so moving any rows is the same few
        ops (the slots past ``extent`` are masked until written, so copying them changes nothing)."""
        if not self.per_layer:
            for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
                for src, dst in zip(src_rows, dst_rows):
                    mine[:, dst, :, :extent].copy_(theirs[:, src, :, :extent])
            return
        # Whole rows (every slot, whatever ``extent``): the index shapes then depend on the two
        # caches alone, a few shapes in all, which lazy mode compiles once each.
        extent = self.length
        device = self.slots.device
        take = source._flat_slots(host_to_device(torch.tensor(src_rows, dtype=torch.long), device), extent)
        put = self._flat_slots(host_to_device(torch.tensor(dst_rows, dtype=torch.long), device), extent)
        for mine, theirs in zip(self.flat_keys + self.flat_values, source.flat_keys + source.flat_values):
            mine.index_copy_(0, put, theirs.index_select(0, take))

    def _flat_slots(self, rows: torch.Tensor, extent: int) -> torch.Tensor:
        """Flat rows of slots 0..extent-1 of every head of ``rows`` [n]: [n * H * extent]."""
        first = self.row_heads.index_select(0, rows)  # [n, H]: slot 0 of each (row, head)
        return (first[:, :, None] + self.slots[None, None, :extent]).reshape(-1)

    def reorder(self, rows: torch.Tensor, upto: int | None = None) -> None:
        """Make row i hold what row ``rows[i]`` held (beam search: follow each beam's parent).

        Only slots below ``upto`` move: the caller passes the next step's attention window, which
        holds every slot written so far; the rest is masked until its row writes it. Done in place
        so the storage, and any graph captured on it, stays valid.
        """
        if self.per_layer:
            # Whole layers: a window of one would be a view written in place.
            for flat, layer in zip(self.flat_keys + self.flat_values, self.keys + self.values):
                flat.copy_(layer.index_select(0, rows).view(flat.shape))
            return
        for cache in (self.keys, self.values):
            live = cache[:, :, :, :upto]  # [n_layer, B, H, upto, D]
            live.copy_(live.index_select(1, rows))
