"""The whole CPU decode step in one C++ call (``csrc/decode_step.cpp``): it must compute what the
op-by-op step of ``StaticBloom.decode`` computes (logits and cache writes), and be used exactly
where it can be. Greedy and beam tokens against transformers are checked by the search tests,
which run through it on CPU in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from bloom_hpu.runtime.cpu import kernels as cpu_kernel
from bloom_hpu.runtime.backends import Backend
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
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=0.1)}


def op_by_op(model: StaticBloom, run):
    """``run()`` with the model's one-call steps switched off."""
    with model.op_by_op():
        return run()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_call_step_equals_the_op_by_op_step(dtype, config):
    """Three rows of different lengths, a window shorter than the cache, six steps: the same logits
    and the same cache contents, whichever step runs."""
    model = random_model(dtype, **config)
    Backend("cpu").prepare_model(model)
    assert model.cpu_decode is not None
    one_call, reference_cache = model.allocate_cache(3, 40), model.allocate_cache(3, 40)
    ids, lengths = torch.randint(4, 1000, (3, 20)), torch.tensor([20, 7, 13])
    op_by_op(model, lambda: model.prefill(ids, lengths, one_call))
    op_by_op(model, lambda: model.prefill(ids, lengths, reference_cache))
    tokens, positions = torch.randint(4, 1000, (3, 1)), lengths.clone()
    tolerance = TOLERANCE[dtype]
    for _ in range(6):
        ours = model.decode(tokens, positions, one_call, 32)
        reference = op_by_op(model, lambda: model.decode(tokens, positions, reference_cache, 32))
        assert ours.shape == reference.shape == (3, 1024) and ours.dtype == dtype
        torch.testing.assert_close(ours, reference, **tolerance)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        torch.testing.assert_close(one_call.keys, reference_cache.keys, **tolerance)
        torch.testing.assert_close(one_call.values, reference_cache.values, **tolerance)
        tokens, positions = reference.argmax(-1)[:, None], positions + 1


# Head sizes of 20 (not whole vectors of 16) and 15 (odd: bf16 pairs of dimensions end in a zero).
PROMPT_CONFIGS = {**CONFIGS, "head-size-20": dict(hidden_size=80, n_layer=2, n_head=4),
                  "head-size-15": dict(hidden_size=60, n_layer=2, n_head=4)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", PROMPT_CONFIGS.values(), ids=PROMPT_CONFIGS.keys())
def test_one_call_prompt_attention_equals_the_op_by_op_one(dtype, config):
    """Rows of 20, 7 and 13 real tokens padded to 20, in a cache of 40 slots: the same last-token
    logits (generation), logits at every real position (scoring) and keys/values in the real
    slots. (Pad positions differ: the one call leaves their attention at zero.)"""
    model = random_model(dtype, **config)
    Backend("cpu").prepare_model(model)
    assert model.prompt_attention is not None
    ids, lengths = torch.randint(4, 1000, (3, 20)), torch.tensor([20, 7, 13])
    for prefill in (model.prefill, model.full_logits):
        one_call, reference_cache = model.allocate_cache(3, 40), model.allocate_cache(3, 40)
        ours = prefill(ids, lengths, one_call)
        reference = op_by_op(model, lambda: prefill(ids, lengths, reference_cache))
        assert ours.shape == reference.shape and ours.dtype == dtype
        for row, length in enumerate(lengths.tolist()):  # pad positions' outputs are never used
            torch.testing.assert_close(ours[row, :length], reference[row, :length], **TOLERANCE[dtype])
            for mine, theirs in ((one_call.keys, reference_cache.keys), (one_call.values, reference_cache.values)):
                torch.testing.assert_close(mine[:, row, :, :length], theirs[:, row, :, :length], **TOLERANCE[dtype])
        last = (lambda t: t[torch.arange(3), lengths - 1]) if ours.dim() == 3 else (lambda t: t)  # [3, V]
        assert torch.equal(last(ours).argmax(-1), last(reference).argmax(-1))


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
def test_one_call_steps_are_used_where_they_can_be(monkeypatch):
    def prepared(dtype=torch.float32, parallel=Parallel(), hidden_size=64, **backend):
        model = random_model(dtype, parallel, hidden_size=hidden_size, n_layer=2, n_head=4)
        Backend("cpu", **backend).prepare_model(model)
        return model

    def used(model):
        return model.cpu_decode is not None, model.prompt_attention is not None

    assert used(prepared()) == used(prepared(torch.bfloat16)) == (True, True)
    assert used(prepared(torch.float16)) == (False, False)  # not a dtype of the kernels
    assert used(prepared(torch.bfloat16, hidden_size=48)) == (False, True)  # 48 bf16 do not fill 64-byte loads
    assert used(prepared(compile_steps=True)) == (False, True)  # torch.compile builds the decode step instead
    assert used(prepared(parallel=Parallel(rank=0, world_size=2))) == (False, True)  # all-reduces stay in Python
    monkeypatch.setenv("BLOOM_CPU_STEP", "0")
    assert used(prepared()) == (False, False)
