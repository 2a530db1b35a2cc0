"""The model's two steps as small modules bound to one KV cache, and the runner that owns them.

A step module's only inputs are the tensors that change per call (token ids, lengths, positions);
the weights and the cache are fixed attributes. That is what graph capture needs: the same step
object always touches the same memory. ``StepRunner`` keeps one cache per (batch, length) shape and
one step module per (cache, window), so repeated calls reuse both and never re-capture.
"""

from __future__ import annotations

import torch
from torch import nn

from .backends import Backend
from ..kv_cache import KVCache
from ..model import StaticBloom


class PrefillStep(nn.Module):
    def __init__(self, model: StaticBloom, cache: KVCache):
        super().__init__()
        self.model = model
        self.cache = cache

    @property
    def static_shape(self) -> tuple:
        return (self.cache.batch_size, self.cache.length)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.model.prefill(input_ids, lengths, self.cache)


class DecodeStep(nn.Module):
    def __init__(self, model: StaticBloom, cache: KVCache, window: int):
        super().__init__()
        self.model = model
        self.cache = cache
        self.window = window

    @property
    def static_shape(self) -> tuple:
        return (self.cache.batch_size, self.cache.length, self.window)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens, positions, self.cache, self.window)


class StepRunner:
    """Runs prefill and decode steps of one model on one backend."""

    def __init__(self, model: StaticBloom, backend: Backend):
        self.model = model
        self.backend = backend
        backend.prepare_model(model)
        self._caches: dict[tuple[int, int], KVCache] = {}
        self._steps: dict[tuple, nn.Module] = {}

    def cache(self, batch_size: int, length: int) -> KVCache:
        """The cache for this shape, allocated on first use and then reused."""
        key = (batch_size, length)
        if key not in self._caches:
            self._caches[key] = self.model.allocate_cache(batch_size, length)
        return self._caches[key]

    def release_caches(self) -> None:
        self._caches.clear()
        self._steps.clear()

    def _step(self, kind: str, cache: KVCache, window: int | None = None) -> nn.Module:
        key = (kind, id(cache), window)
        if key not in self._steps:
            step = PrefillStep(self.model, cache) if kind == "prefill" else DecodeStep(self.model, cache, window)
            self._steps[key] = self.backend.prepare(step)
        return self._steps[key]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.backend.run("prefill", self._step("prefill", cache), input_ids, lengths)

    @torch.no_grad()
    def prefill_shared(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache, copies: int) -> torch.Tensor:
        """Prefill B prompts [B, P] once each for a cache of B * ``copies`` rows, prompt-major
        (beams, sampled copies): the prompts run in a B-row cache of length P, whose slots every
        copy then takes. Logits [B * copies, V]. transformers runs all B * copies rows instead."""
        if copies == 1:
            return self.prefill(input_ids, lengths, cache)
        prompts = self.cache(input_ids.shape[0], input_ids.shape[1])
        logits = self.prefill(input_ids, lengths, prompts)
        cache.copy_prompts(prompts, copies)
        return logits.repeat_interleave(copies, dim=0)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        return self.backend.run("decode", self._step("decode", cache, window), tokens, positions)
