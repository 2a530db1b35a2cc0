"""The preallocated key/value cache, written in place.

One cache is allocated per (batch, length) shape and reused by every call of that shape, so its
storage never moves: captured graphs can keep pointing at it. Steps write into it with
``narrow().copy_`` (prefill, a static slice) and indexed assignment (decode, one slot per row at a
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
    # Index vectors the decode step needs every time, made once (an arange costs as much as a
    # small matmul on CPU, and a captured graph may keep pointing at these): [B] rows, [K] slots.
    rows: torch.Tensor  # [B] 0..B-1
    slots: torch.Tensor  # [K] 0..K-1

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
        rows = torch.arange(batch_size, device=device)
        slots = torch.arange(length, device=device)
        return cls(keys, values, alibi_bias(slopes.to(device), length, batch_size, dtype), rows, slots)

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
        # Indexed assignment (index_put_) writes just the B*H*D new values. Not ``scatter_``: on CPU
        # in bf16 it copies the whole layer of the cache twice per call (measured: 1.6 ms per call
        # at K=2048; a bloom-560m decode step makes 48 such calls).
        self.keys[layer][self.rows, :, positions] = k[:, :, 0]  # [B, H, D] at (row, all heads, slot)
        self.values[layer][self.rows, :, positions] = v[:, :, 0]

    def copy_prompts(self, prompts: "KVCache", copies: int) -> None:
        """Rows c*i .. c*i+c-1 (c = ``copies``) take the slots of row i of ``prompts``, a cache of
        B rows as long as the prompt: beams and sampled copies of a prompt share its one prefill."""
        b, length = prompts.batch_size, prompts.length
        for mine, theirs in ((self.keys, prompts.keys), (self.values, prompts.values)):
            # [n_layer, B*c, H, P, D] seen as [n_layer, B, c, H, P, D]; theirs broadcast over c.
            mine[:, :, :, :length].unflatten(1, (b, copies)).copy_(theirs[:, :, None])

    def reorder(self, rows: torch.Tensor, upto: int | None = None) -> None:
        """Make row i hold what row ``rows[i]`` held (beam search: follow each beam's parent).

        Only slots below ``upto`` move: the caller passes the next step's attention window, which
        holds every slot written so far; the rest is masked until its row writes it. Done in place
        so the storage, and any graph captured on it, stays valid.
        """
        for cache in (self.keys, self.values):
            live = cache[:, :, :, :upto]  # [n_layer, B, H, upto, D]
            live.copy_(live.index_select(1, rows))
