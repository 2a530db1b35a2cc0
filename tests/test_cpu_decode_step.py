"""The whole CPU decode step in one C++ call (``csrc/decode_step.cpp``): it must compute what the
op-by-op step of ``StaticBloom.decode`` computes (logits and cache writes), and be used exactly
where it can be. Greedy and beam tokens against transformers are checked by the search tests,
which run through it on CPU in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from bloom_hpu import cpu_kernel
from bloom_hpu.backends import Backend
from bloom_hpu.config import BloomConfig
from bloom_hpu.model import StaticBloom
from bloom_hpu.parallel import Parallel
from utils.random_checkpoint import random_weights

needs_kernel = pytest.mark.skipif(not (cpu_kernel.cpu_supports_bf16_dot() and cpu_kernel.compiler_found()),
                                  reason="CPU without AVX512-BF16, or no C++ compiler")


def random_model(dtype, parallel=Parallel(), **config) -> StaticBloom:
    config = BloomConfig(**{"vocab_size": 1024, **config})
    model = StaticBloom(config, parallel)
    if parallel.world_size == 1:  # (a rank of a split model keeps its own initial weights)
        model.load_state_dict(random_weights(config, live_vocab=1000, seed=config.n_head, weight_scale=1.0))
    return model.to(dtype).eval().requires_grad_(False)


CONFIGS = {  # 6 heads: slopes of a non-power of two; residual from the layer norm: the other residual
    "heads4": dict(hidden_size=64, n_layer=2, n_head=4),
    "heads6-residual-from-ln": dict(hidden_size=96, n_layer=3, n_head=6, apply_residual_connection_post_layernorm=True),
}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_call_step_equals_the_op_by_op_step(dtype, config):
    """Three rows of different lengths, a window shorter than the cache, six steps: the same logits
    and the same cache contents, whichever step runs."""
    model = random_model(dtype, **config)
    Backend("cpu").prepare_model(model)
    assert model.cpu_decode is not None
    one_call, op_by_op = model.allocate_cache(3, 40), model.allocate_cache(3, 40)
    ids, lengths = torch.randint(4, 1000, (3, 20)), torch.tensor([20, 7, 13])
    model.prefill(ids, lengths, one_call)
    model.prefill(ids, lengths, op_by_op)
    tokens, positions = torch.randint(4, 1000, (3, 1)), lengths.clone()
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=0.1)
    for _ in range(6):
        ours = model.decode(tokens, positions, one_call, 32)
        step, model.cpu_decode = model.cpu_decode, None
        reference = model.decode(tokens, positions, op_by_op, 32)
        model.cpu_decode = step
        assert ours.shape == reference.shape == (3, 1024) and ours.dtype == dtype
        torch.testing.assert_close(ours, reference, **tolerance)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        torch.testing.assert_close(one_call.keys, op_by_op.keys, **tolerance)
        torch.testing.assert_close(one_call.values, op_by_op.values, **tolerance)
        tokens, positions = reference.argmax(-1)[:, None], positions + 1


@needs_kernel
def test_the_step_refuses_positions_outside_the_cache():
    model = random_model(torch.float32, hidden_size=64, n_layer=2, n_head=4)
    Backend("cpu").prepare_model(model)
    cache = model.allocate_cache(1, 8)
    with pytest.raises(RuntimeError, match="position outside the cache"):
        model.decode(torch.tensor([[5]]), torch.tensor([8]), cache, 8)
    with pytest.raises(RuntimeError, match="token id out of the vocabulary"):
        model.decode(torch.tensor([[1024]]), torch.tensor([2]), cache, 8)


@needs_kernel
def test_one_call_step_is_used_where_it_can_be(monkeypatch):
    def prepared(dtype=torch.float32, parallel=Parallel(), hidden_size=64, **backend):
        model = random_model(dtype, parallel, hidden_size=hidden_size, n_layer=2, n_head=4)
        Backend("cpu", **backend).prepare_model(model)
        return model

    assert prepared().cpu_decode is not None
    assert prepared(torch.bfloat16).cpu_decode is not None
    assert prepared(torch.float16).cpu_decode is None  # not a dtype of the kernel
    assert prepared(torch.bfloat16, hidden_size=48).cpu_decode is None  # 48 bf16 do not fill 64-byte loads
    assert prepared(compile_steps=True).cpu_decode is None  # torch.compile builds the step instead
    assert prepared(parallel=Parallel(rank=0, world_size=2)).cpu_decode is None  # its all-reduces stay in Python
    monkeypatch.setenv("BLOOM_CPU_STEP", "0")
    assert prepared().cpu_decode is None
