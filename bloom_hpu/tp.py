"""Tensor parallelism, in one place: how a run of N ranks splits BLOOM and talks between ranks.

* ``Parallel``: what the model asks of its peers: its rank and world size, which vocabulary rows it
  holds, and two collectives. ``SINGLE`` is the one-process case, where every collective is the
  identity; ``DistributedParallel`` runs them through torch.distributed.
* The two parallel layers the model is built from: ``RowParallelLinear`` (input features split,
  partial sums all-reduced) and ``VocabParallelEmbedding`` (vocabulary rows split). The other
  linears are column-parallel: plain linears with fewer output rows, nothing to exchange.
* ``shard_slices``: the sharding plan, which rows or columns of each checkpoint tensor a rank reads.
* ``check_splittable``: heads must split evenly over the ranks (the vocabulary need not).

Joining the launcher's process group, checking that ranks agree and routing their output is the
runtime's (``runtime/launch.py``): this module only describes the split.

Both collectives give every rank bitwise the same result, so all ranks choose the same tokens: an
all-reduce ends with every rank holding one reduced copy, and the all-gather concatenates in rank
order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import BloomConfig

if TYPE_CHECKING:
    from .model import StaticBloom


# --- what the model asks of its peers -------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # device index on this host

    def vocab_shard(self, vocab_size: int) -> int:
        """Vocabulary rows every rank holds: ceil(vocab_size / world_size). Where the vocabulary does
        not divide, the last rank's shard ends in zero pad rows (as Megatron and DeepSpeed pad),
        so every shard has one shape and the gather of the logits stays a plain all_gather."""
        return -(-vocab_size // self.world_size)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows this rank holds (equal blocks, the last may be
        short; its shard is padded up to ``vocab_shard``)."""
        per_rank = self.vocab_shard(vocab_size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order), keeping the first
        ``size`` columns: the pad columns of a padded vocabulary are dropped, so no pad id can ever
        be chosen or scored."""
        return x if size is None or x.shape[-1] == size else x[..., :size]


SINGLE = Parallel()


@dataclass(frozen=True)
class DistributedParallel(Parallel):
    """Collectives over one torch.distributed process group (initialised by the caller): the whole
    world, or with data parallelism this replica's own group (``group``; ``rank`` and ``world_size``
    are then the rank and size inside it), so one replica's collectives never wait on another's.

    The collectives are the plain in-place c10d ones: CUDA graphs can capture NCCL calls, and HPU
    graphs capture hccl calls when PT_HPU_ENABLE_LAZY_COLLECTIVES is set (see runtime/backends.py).
    """

    device: str = "cpu"  # where the collective backend takes tensors: cpu (gloo), cuda:i, hpu
    group: object = None  # the process group of these ranks; None: the default (whole world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x is always a fresh activation (a matmul output), so reducing in place is safe.
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        # Every rank holds the same number of vocabulary rows (the last shard is padded, see
        # vocab_shard), so the pieces have equal shapes, as all_gather requires.
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(pieces, x, group=self.group)
        out = torch.cat(pieces, dim=-1)
        return out if size is None or out.shape[-1] == size else out[..., :size].contiguous()


# --- the parallel layers ----------------------------------------------------------------------------


class RowParallelLinear(nn.Linear):
    """A linear whose input features are split across ranks: partial sums are all-reduced, and the
    bias (kept whole on every rank) is added once, after the reduction. Its product is one method,
    as the model's ``Linear``'s, for the runtime's kernels."""

    def __init__(self, in_features: int, out_features: int, parallel: Parallel):
        super().__init__(in_features, out_features)
        self.parallel = parallel

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self.product(x, self.bias)
        return self.parallel.all_reduce(self.product(x, None)) + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Word embeddings split by vocabulary rows across ranks (the LM head reuses them, tied).

    Every rank holds ``vocab_shard`` rows; on the last rank those past ``vocab_end`` are zero pad
    rows that no id looks up (ids outside the real range are masked) and whose logits the gather
    drops."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel):
        self.vocab_start, self.vocab_end = parallel.vocab_range(vocab_size)
        super().__init__(parallel.vocab_shard(vocab_size), hidden_size)
        self.parallel = parallel

    def forward(self, ids):
        if self.parallel.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return self.parallel.all_reduce(out)


# --- the sharding plan ------------------------------------------------------------------------------


def shard_slices(name: str, model: "StaticBloom") -> tuple[slice | None, slice | None]:
    """(rows, cols) of checkpoint tensor ``name`` that this rank holds; None means all.

    Column-parallel weights (fused QKV by whole heads, dense_h_to_4h) split their output rows;
    row-parallel ones (attention dense, dense_4h_to_h) split their input columns and keep the bias
    whole; the word embeddings split vocabulary rows. Everything else is replicated.
    """
    par, cfg = model.parallel, model.config
    if par.world_size == 1:
        return None, None

    def block(total: int) -> slice:
        per = total // par.world_size
        return slice(par.rank * per, (par.rank + 1) * per)

    if name == "word_embeddings.weight":
        return slice(*par.vocab_range(cfg.vocab_size)), None
    if ".self_attention.query_key_value." in name:
        # Rows are laid out [head, (q, k, v), head_dim]: whole heads are contiguous row blocks.
        return block(3 * cfg.hidden_size), None
    if ".mlp.dense_h_to_4h." in name:
        return block(4 * cfg.hidden_size), None
    if name.endswith(".self_attention.dense.weight"):
        return None, block(cfg.hidden_size)
    if name.endswith(".mlp.dense_4h_to_h.weight"):
        return None, block(4 * cfg.hidden_size)
    return None, None


# --- what a split must satisfy ---------------------------------------------------------------------


class ParallelError(ValueError):
    """A tensor-parallel run cannot go on. Every rank raises the same one, so rank 0 alone reports it."""


def check_splittable(config: BloomConfig, world_size: int) -> None:
    """Tensor parallelism splits heads and the MLP in equal whole parts (any vocabulary splits: its
    last shard is padded)."""
    if world_size <= 1:
        return
    if world_size > config.n_head:
        raise ParallelError(
            f"{world_size} ranks is more than the model's {config.n_head} attention heads; "
            f"run on at most {config.n_head} cards"
        )
    if config.n_head % world_size:
        divisors = [n for n in range(1, config.n_head + 1) if config.n_head % n == 0]
        raise ParallelError(
            f"the model's {config.n_head} attention heads cannot be split evenly over {world_size} ranks; "
            f"use a number of cards that divides {config.n_head}: {', '.join(map(str, divisors))}"
        )
