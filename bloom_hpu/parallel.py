"""How the model talks to its peer ranks under tensor parallelism.

``Parallel`` is the small interface the model uses: its rank and world size, which vocabulary rows
it holds, and the two collectives it needs. ``SINGLE`` is the one-process case, where every
collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # device index on this host

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rows this rank holds (equal blocks, the last may be short)."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        return x


SINGLE = Parallel()
