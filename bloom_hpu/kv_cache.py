"""The preallocated key/value cache, written in place.

One cache is allocated per (batch, length) shape and reused by every call of that shape, so its
storage never moves: captured graphs can keep pointing at it. Steps write into it with
``narrow().copy_`` (prefill, a static slice) and ``scatter_`` (decode, one slot per row at a
position held in a device tensor); nothing ever grows it with ``torch.cat``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .alibi import alibi_bias


@dataclass
class KVCache:
    keys: torch.Tensor  # [n_layer, B, H, K, D]
    values: torch.Tensor  # [n_layer, B, H, K, D]
    alibi: torch.Tensor  # [B * H, 1, K]: slope[h] * slot, precomputed once

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
    ) -> "KVCache":
        shape = (n_layer, batch_size, n_head, length, head_dim)
        # Zeros, not empty: unwritten slots are masked, but 0 * NaN garbage would still poison
        # the attention-weighted sum of values.
        keys = torch.zeros(shape, dtype=dtype, device=device)
        values = torch.zeros(shape, dtype=dtype, device=device)
        return cls(keys, values, alibi_bias(slopes.to(device), length, batch_size, dtype))

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prefill's keys/values [B, H, P, D] in slots 0..P-1 (P is a static shape)."""
        prompt_len = k.shape[2]
        self.keys[layer].narrow(2, 0, prompt_len).copy_(k)
        self.values[layer].narrow(2, 0, prompt_len).copy_(v)

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one new token's keys/values [B, H, 1, D] at each row's own slot ``positions`` [B]."""
        b, h, _, d = k.shape
        index = positions.view(b, 1, 1, 1).expand(b, h, 1, d)
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)

    def reorder(self, rows: torch.Tensor) -> None:
        """Make row i hold what row ``rows[i]`` held (beam search: follow each beam's parent).

        Done in place so the storage, and any graph captured on it, stays valid.
        """
        self.keys.copy_(self.keys.index_select(1, rows))
        self.values.copy_(self.values.index_select(1, rows))
