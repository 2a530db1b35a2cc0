"""The verify step of speculative decoding: S tokens of every row over its cache, one pass.

Row b's last token and its guesses, ids [B, S], go to slots ``starts[b]`` .. ``starts[b] + S - 1``
(clamped to the cache) and each attends the row's slots up to its own (``StaticBloom.extend_hidden``,
the prefix cache's continuation); the logits of every position come back, [B, S, V]. Its shape is
(rows, cache length, window, S): a fixed set per call, captured like the decode step. A rejected
guess's keys and values stay in its slot until the row writes the slot again; nothing attends
them before (every position attends slots up to its own only).

A step of the runner like the others (``steps.py``): one module per (cache, window), through the
backend, which records its signature and captures it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..int8_activations import as_decode_rows
from ..kv_cache import KVCache
from ..model import StaticBloom


class VerifyStep(nn.Module):
    def __init__(self, model: StaticBloom, cache: KVCache, window: int):
        super().__init__()
        self.model = model
        self.cache = cache
        self.window = window

    @property
    def static_shape(self) -> tuple:
        return (self.cache.batch_size, self.cache.length, self.window)

    def forward(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        # ids [B, S], starts [B] -> logits [B, S, V]
        with as_decode_rows():  # quantized products as the decode steps this pass stands for take them
            return self.model.lm_head(self.model.extend_hidden(ids, starts, self.cache, self.window))


@torch.no_grad()
def verify(runner, ids: torch.Tensor, starts: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
    """Logits [B, S, V] of ids [B, S] written from slots ``starts`` [B], attending slots < ``window``.
    The step module is kept with the runner's others, one per (cache, window)."""
    key = ("verify", id(cache), window)
    step = runner._steps.get(key)
    if step is None:
        step = runner._steps[key] = runner.backend.prepare(VerifyStep(runner.model, cache, window))
    return runner.backend.run("verify", step, ids, starts)
