"""The memory a configuration needs on each rank, and what is free there, before anything is allocated.

need = weights (this rank's share, as held: int8 a byte a weight, int4 half a byte plus a scale per
64) + the KV cache and step buffers of ``max_batch`` rows of ``input + output`` tokens (the
arithmetic of ``generation/request/memory.py``, which the library's own check uses) + the prefix
pool. While the weights load they are in the activation dtype first (int8 and int4 are quantized
after loading), so loading needs that size. Like the library's check it is an upper bound within
a small factor: meant to skip what cannot fit, never to refuse what does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from generation.request.memory import agreed_free_bytes, estimate_bytes, human

from .sweep import ACTIVATION_DTYPES

BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 64}


@dataclass
class Need:
    weights: int  # held, this rank's share
    loading: int  # while loading: the weights in the activation dtype, plus the cache
    cache: int  # KV cache and step buffers
    prefix_pool: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.prefix_pool

    @property
    def held(self) -> int:
        """What is allocated before a configuration runs: the dtype's weights and the pool."""
        return self.weights + self.prefix_pool

    @property
    def added(self) -> int:
        return self.cache

    def describe(self) -> str:
        return f"weights {human(self.weights)} + cache {human(self.cache)} + prefix pool {human(self.prefix_pool)}"


def weights_per_rank(spec: dict, world_size: int) -> tuple[int, int]:
    """(sharded, replicated) weights on one rank: the products and the embedding split over the
    ranks, LayerNorms and the row-parallel biases whole on each."""
    h, layers = spec["hidden_size"], spec["n_layer"]
    sharded = spec["vocab_size"] * h + layers * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h)
    replicated = 4 * h + layers * (4 * h + 2 * h)
    return -(-sharded // world_size), replicated


def memory_need(spec: dict, dtype: str, config: dict, world_size: int, prefix_pool: int) -> Need:
    from bloom_hpu.config import BloomConfig

    act = getattr(torch, ACTIVATION_DTYPES[dtype])
    act_bytes = torch.empty((), dtype=act).element_size()
    sharded, replicated = weights_per_rank(spec, world_size)
    weights = int(sharded * BYTES_PER_WEIGHT[dtype] + replicated * act_bytes)
    model = BloomConfig(vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"], n_layer=spec["n_layer"],
                        n_head=spec["n_head"])
    length = config["input_len"] + config["output_len"]
    cache = estimate_bytes(model, act, config["max_batch"], length, config["input_len"], world_size)
    loading = (sharded + replicated) * act_bytes + cache + prefix_pool
    return Need(weights, max(loading, weights + cache + prefix_pool), cache, prefix_pool)


def free_per_rank(device: str | None, parallel) -> int | None:
    """Free memory for one rank: the least over the ranks (so all take the same decision); on the
    CPU the host's free memory is shared by the ranks on it, so it is divided among them."""
    from bloom_hpu.runtime.backends import default_device
    from bloom_hpu.runtime.launch import launch_info

    kind = (device or default_device()).split(":")[0]
    free = agreed_free_bytes(torch.device(kind if kind != "cuda" else f"cuda:{parallel.local_rank}"), parallel)
    if free is None or kind != "cpu":
        return free
    info = launch_info()
    return free // (info.local_size if info else 1)
