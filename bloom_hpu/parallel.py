"""How the model talks to its peer ranks under tensor parallelism.

``Parallel`` is the small interface the model uses: its rank and world size, which vocabulary rows
it holds, and the two collectives it needs. ``SINGLE`` is the one-process case, where every
collective is the identity. ``DistributedParallel`` runs the collectives through torch.distributed
(gloo on cpu, nccl on cuda, hccl on hpu; see ``distributed.py`` for the setup).

Both collectives give every rank bitwise the same result, so all ranks choose the same tokens:
an all-reduce ends with every rank holding one reduced copy, and the all-gather concatenates in
rank order.
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


@dataclass(frozen=True)
class DistributedParallel(Parallel):
    """Collectives over the default torch.distributed process group (initialised by the caller).

    The collectives are the plain in-place c10d ones: CUDA graphs can capture NCCL calls, and HPU
    graphs capture hccl calls when PT_HPU_ENABLE_LAZY_COLLECTIVES is set (see backends.py).
    """

    device: str = "cpu"  # where the collective backend takes tensors: cpu (gloo), cuda:i, hpu

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x is always a fresh activation (a matmul output), so reducing in place is safe.
        torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank holds the same number of vocabulary rows (distributed.check_splittable asks
        # vocab_size % world_size == 0), so the pieces have equal shapes, as all_gather requires.
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(pieces, x)
        return torch.cat(pieces, dim=-1)
