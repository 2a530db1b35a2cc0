"""The one-call CPU steps (``csrc/decode_step.cpp``, ``csrc/prompt_attention.cpp``), for each ISA
build this CPU can run and each dtype: they must compute what the op-by-op steps of
``StaticBloom`` compute (logits and cache writes), and be used exactly where they can be. Greedy
and beam tokens against transformers are checked by the search tests, which run through them."""

from __future__ import annotations

import pytest
import torch

from bloom_hpu.config import BloomConfig
from bloom_hpu.model import StaticBloom
from bloom_hpu.tp import Parallel
from bloom_hpu.runtime.cpu import CpuOptions, accelerate
from bloom_hpu.runtime.cpu.kernels import load
from bloom_hpu.runtime.cpu.layers import AMX_MIN_ROWS
from isas import ALL_KERNEL_ISAS, KERNEL_ISAS, needs_isa
from utils.random_checkpoint import random_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=0.1),
             torch.float16: dict(rtol=2e-3, atol=2e-2)}


def accelerated(isa: str, dtype, parallel=Parallel(), **config):
    """A random model on ``isa``'s kernels, and its plan (``plan.op_by_op()`` turns the one-call
    steps off); the model's ``decode`` is the op-by-op one, ``plan.decode`` the one call."""
    needs_isa(isa)
    model = random_model(dtype, parallel, **config)
    return model, accelerate(model, CpuOptions(path=isa))


def op_by_op(plan, run):
    """``run()`` with the one-call steps switched off."""
    with plan.op_by_op():
        return run()


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_call_step_equals_the_op_by_op_step(isa, dtype, config):
    """Three rows of different lengths, a window shorter than the cache, six steps: the same logits
    and the same cache contents, whichever step runs."""
    model, plan = accelerated(isa, dtype, **config)
    assert plan.decode is not None
    one_call, reference_cache = model.allocate_cache(3, 40), model.allocate_cache(3, 40)
    torch.manual_seed(0)  # the same prompts whichever tests ran before (not the global stream's next draw)
    ids, lengths = torch.randint(4, 1000, (3, 20)), torch.tensor([20, 7, 13])
    op_by_op(plan, lambda: model.prefill(ids, lengths, one_call))
    op_by_op(plan, lambda: model.prefill(ids, lengths, reference_cache))
    tokens, positions = torch.randint(4, 1000, (3, 1)), lengths.clone()
    tolerance = TOLERANCE[dtype]
    for _ in range(6):
        ours = plan.decode(tokens, positions, one_call, 32)
        reference = op_by_op(plan, lambda: model.decode(tokens, positions, reference_cache, 32))
        assert ours.shape == reference.shape == (3, 1024) and ours.dtype == dtype
        torch.testing.assert_close(ours, reference, **tolerance)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        torch.testing.assert_close(one_call.keys, reference_cache.keys, **tolerance)
        torch.testing.assert_close(one_call.values, reference_cache.values, **tolerance)
        tokens, positions = reference.argmax(-1)[:, None], positions + 1


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_call_mixed_step_equals_the_op_by_op_one(isa, dtype, config):
    """The server's mixed step (``StaticBloom.mixed``) as one call: 4 running rows, row 3 joining
    with a prompt whose two pieces ride in one step (the second shorter, padded, its slots clamped
    at the cache's end), and a decode token of row 3 (its filler) at the slot its first piece then
    overwrites. After the first step the second piece is repeated, as ``DeviceRows.mixed`` pads the
    segment count. The one call leaves out pad tokens, repeats and the filler, whose logits are
    zeros. Three steps: the same logits (the running rows' and each piece's last token's) and cache
    contents."""
    model, plan = accelerated(isa, dtype, **config)
    assert plan.decode is not None
    one_call, reference_cache = model.allocate_cache(4, 24), model.allocate_cache(4, 24)
    torch.manual_seed(1)
    ids, lengths = torch.randint(4, 1000, (4, 12)), torch.tensor([12, 7, 9, 1])
    op_by_op(plan, lambda: model.prefill(ids, lengths, one_call))
    op_by_op(plan, lambda: model.prefill(ids, lengths, reference_cache))
    tokens, positions = torch.randint(4, 1000, (4, 1)), lengths.clone()
    # The last step's second piece ends at slot 22 and its pad tokens run past the cache's 24 slots
    # (clamped onto slot 23), as for the longest prompt the engine takes (max_length - 1 tokens).
    for start in (1, 9, 12):
        positions[3] = start
        chunk = torch.randint(4, 1000, (2, 8))
        rows, starts, real = torch.tensor([3, 3]), torch.tensor([start, start + 8]), torch.tensor([8, 3])
        if start > 1:  # the second piece again
            chunk, rows, starts, real = (torch.cat([t, t[-1:]]) for t in (chunk, rows, starts, real))
        ours = plan.decode.mixed(tokens, positions, chunk, rows, starts, real, one_call, 24)
        reference = op_by_op(plan, lambda: model.mixed(tokens, positions, chunk, rows, starts, real, reference_cache, 24))
        assert ours.shape == reference.shape == (4 + len(rows), 1024) and ours.dtype == dtype
        assert not ours[3].any()  # row 3's filler
        returned = [0, 1, 2] + list(range(4, 4 + len(rows)))
        torch.testing.assert_close(ours[returned], reference[returned], **TOLERANCE[dtype])
        assert torch.equal(ours[returned].argmax(-1), reference[returned].argmax(-1))
        seen = start + 11  # row 3's slots past its prompt's real tokens hold pad tokens' keys, never attended
        for mine, theirs in ((one_call.keys, reference_cache.keys), (one_call.values, reference_cache.values)):
            torch.testing.assert_close(mine[:, :3], theirs[:, :3], **TOLERANCE[dtype])
            torch.testing.assert_close(mine[:, 3, :, :seen], theirs[:, 3, :, :seen], **TOLERANCE[dtype])
        tokens, positions = reference[:4].argmax(-1)[:, None], positions + 1


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_call_verify_equals_the_op_by_op_one_and_the_decode_steps(isa, dtype, config):
    """Speculation's verify pass (``StaticBloom.extend_hidden`` + head) as one call: 3 rows of 5
    positions each, row 2's last ones clamped at the cache's end. The same logits and cache contents
    as op by op; and position j's logits are, bit for bit, those of the one-call decode step that
    would have read the same token at the same slot (an accepted guess is what the plain loop
    would have computed, near ties included)."""
    model, plan = accelerated(isa, dtype, **config)
    assert plan.decode is not None
    caches = [model.allocate_cache(3, 24) for _ in range(3)]  # one call, op by op, decode steps
    torch.manual_seed(3)
    prompt, lengths = torch.randint(4, 1000, (3, 12)), torch.tensor([12, 5, 21])
    prompt = torch.cat([prompt, torch.randint(4, 1000, (3, 9))], 1)
    for cache in caches:
        op_by_op(plan, lambda: model.prefill(prompt, lengths, cache))
    ids, starts = torch.randint(4, 1000, (3, 5)), lengths.clone()
    ours = plan.decode.verify(ids, starts, caches[0], 24)
    reference = op_by_op(plan, lambda: model.lm_head(model.extend_hidden(ids, starts, caches[1], 24)))
    assert ours.shape == reference.shape == (3, 5, 1024) and ours.dtype == dtype
    inside = [(0, j) for j in range(5)] + [(1, j) for j in range(5)] + [(2, 0), (2, 1), (2, 2)]  # unclamped
    rows, positions = torch.tensor([r for r, _ in inside]), torch.tensor([j for _, j in inside])
    torch.testing.assert_close(ours[rows, positions], reference[rows, positions], **TOLERANCE[dtype])
    assert torch.equal(ours[rows, positions].argmax(-1), reference[rows, positions].argmax(-1))
    for mine, theirs in ((caches[0].keys, caches[1].keys), (caches[0].values, caches[1].values)):
        torch.testing.assert_close(mine[:, :2, :, :17], theirs[:, :2, :, :17], **TOLERANCE[dtype])
    for j in range(3):  # rows 0 and 1 one decode step at a time (row 2 at slot 0: left out)
        step_positions = torch.tensor([starts[0] + j, starts[1] + j, 0])
        decoded = plan.decode(ids[:, j:j + 1], step_positions, caches[2], 24)
        assert torch.equal(decoded[:2], ours[:2, j])


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_call_verify_with_segments_equals_the_op_by_op_one(isa, dtype):
    """The server's verify pass carrying prompt segments (``StaticBloom.verify_mixed``) as one call:
    rows 0 and 1 verify 3 positions each while row 2's prompt joins in two pieces (the second
    shorter, then repeated to pad the segment count). The same logits and cache contents."""
    model, plan = accelerated(isa, dtype, **CONFIGS["heads4"])
    one_call, reference_cache = model.allocate_cache(3, 32), model.allocate_cache(3, 32)
    torch.manual_seed(4)
    prompt, lengths = torch.randint(4, 1000, (3, 10)), torch.tensor([10, 6, 1])
    for cache in (one_call, reference_cache):
        op_by_op(plan, lambda: model.prefill(prompt, lengths, cache))
    ids, starts = torch.randint(4, 1000, (3, 3)), torch.tensor([10, 6, 0])
    chunk = torch.randint(4, 1000, (3, 6))
    chunk[2] = chunk[1]  # a repeat: the same row, start and ids
    rows, chunk_starts, real = torch.tensor([2, 2, 2]), torch.tensor([0, 6, 6]), torch.tensor([6, 4, 4])
    ours = plan.decode.verify_mixed(ids, starts, chunk, rows, chunk_starts, real, one_call, 32)
    reference = op_by_op(plan, lambda: model.verify_mixed(ids, starts, chunk, rows, chunk_starts, real,
                                                          reference_cache, 32))
    assert ours.shape == reference.shape == (9 + 3, 1024)
    returned = list(range(6)) + [9, 10, 11]  # rows 0 and 1's positions, then each segment's last token
    torch.testing.assert_close(ours[returned], reference[returned], **TOLERANCE[dtype])
    assert torch.equal(ours[returned].argmax(-1), reference[returned].argmax(-1))
    for mine, theirs in ((one_call.keys, reference_cache.keys), (one_call.values, reference_cache.values)):
        torch.testing.assert_close(mine[:, :2, :, :13], theirs[:, :2, :, :13], **TOLERANCE[dtype])
        torch.testing.assert_close(mine[:, 2, :, :10], theirs[:, 2, :, :10], **TOLERANCE[dtype])


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights", ["float", "int8"])
def test_one_call_steps_leave_out_the_rows_at_slot_0(isa, dtype, weights):
    """A server's batch holds free rows and rows whose prompt has not begun, at slot 0: the one-call
    decode and mixed steps (over float or int8 weights) compute only the others (the idle rows'
    logits are zeros), and those get the op-by-op step's logits and cache contents."""
    from bloom_hpu.quantize import quantize

    needs_isa(isa)
    model = random_model(dtype, **CONFIGS["heads4"])
    if weights == "int8":
        quantize(model, "int8", None)
    plan = accelerate(model, CpuOptions(path=isa))
    assert plan.decode is not None
    one_call, reference_cache = model.allocate_cache(5, 32), model.allocate_cache(5, 32)
    torch.manual_seed(2)
    ids, lengths = torch.randint(4, 1000, (5, 10)), torch.tensor([10, 1, 6, 1, 8])
    op_by_op(plan, lambda: model.prefill(ids, lengths, one_call))
    op_by_op(plan, lambda: model.prefill(ids, lengths, reference_cache))
    running, idle = [0, 2, 4], [1, 3]
    tokens, positions = torch.randint(4, 1000, (5, 1)), lengths.clone()
    positions[idle] = 0
    tolerance = TOLERANCE[dtype]
    for step in range(4):
        if step < 2:
            ours = plan.decode(tokens, positions, one_call, 32)
            reference = op_by_op(plan, lambda: model.decode(tokens, positions, reference_cache, 32))
        else:  # row 3's prompt joins in a piece of 5 tokens from slot 0 (its filler sits there)
            chunk, rows, starts, real = torch.randint(4, 1000, (1, 8)), torch.tensor([3]), torch.tensor([0]), \
                torch.tensor([5])
            ours = plan.decode.mixed(tokens, positions, chunk, rows, starts, real, one_call, 32)
            reference = op_by_op(plan, lambda: model.mixed(tokens, positions, chunk, rows, starts, real,
                                                           reference_cache, 32))
            torch.testing.assert_close(ours[5:], reference[5:], **tolerance)  # the piece's last token
        assert not ours[idle].any() and reference[idle].any()
        torch.testing.assert_close(ours[running], reference[running], **tolerance)
        assert torch.equal(ours[running].argmax(-1), reference[running].argmax(-1))
        for mine, theirs in ((one_call.keys, reference_cache.keys), (one_call.values, reference_cache.values)):
            torch.testing.assert_close(mine[:, running], theirs[:, running], **tolerance)
        tokens[running], positions[running] = reference[running].argmax(-1)[:, None], positions[running] + 1


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_mixed_steps_take_the_one_call_up_to_their_limit(isa):
    """The backend runs a mixed step as one call up to ``plan.mixed_rows`` tokens, op by op past it,
    with the same tokens either way."""
    from bloom_hpu.runtime.backends import Backend
    from bloom_hpu.runtime.steps import StepRunner

    needs_isa(isa)
    model = random_model(torch.float32, hidden_size=64, n_layer=2, n_head=4)
    backend = Backend("cpu", cpu=CpuOptions(path=isa))
    runner = StepRunner(model, backend)
    plan = backend.cpu_plan
    assert plan.mixed_rows == 80
    # Over quantized weights (fp32 on the AVX2 build: 16 rows in the decode step), up to 48 tokens.
    from bloom_hpu.quantize import quantize

    for mode, group in (("int8", None), ("int4", 32)):
        quantized = quantize(random_model(torch.float32, hidden_size=64, n_layer=2, n_head=4), mode, group)
        assert accelerate(quantized, CpuOptions(path="avx2")).mixed_rows == 48, mode
    calls = []
    one_call = plan.decode.mixed
    plan.decode.mixed = lambda *args: calls.append(args[0].shape[0] + args[2].numel()) or one_call(*args)
    results = []
    # 4 rows, 2 of them joining (their fillers not computed) with pieces of 4 and 2 real tokens (8
    # padded): 8 tokens, then op by op.
    for limit in (80, 8):
        plan.mixed_rows = limit
        cache = model.allocate_cache(4, 32)
        ids, lengths = torch.randint(4, 1000, (4, 10), generator=torch.Generator().manual_seed(2)), torch.full((4,), 10)
        tokens = runner.prefill(ids, lengths, cache).argmax(-1)[:, None]
        chunk = torch.arange(100, 108).view(2, 4)
        rows, starts, real = torch.tensor([3, 2]), torch.tensor([10, 10]), torch.tensor([4, 2])
        returned = [0, 1, 4, 5]  # the running rows' and the pieces' (the fillers' are zeros in the one call)
        results.append(runner.mixed(tokens, lengths, chunk, rows, starts, real, cache, 16)[returned].argmax(-1))
        plan.mixed_rows = 7
        results.append(runner.mixed(tokens, lengths, chunk, rows, starts, real, cache, 16)[returned].argmax(-1))
    assert calls == [12, 12]
    assert all(torch.equal(r, results[0]) for r in results)


# Head sizes of 20 (not whole vectors of 16) and 15 (odd: bf16 pairs of dimensions end in a zero).
PROMPT_CONFIGS = {**CONFIGS, "head-size-20": dict(hidden_size=80, n_layer=2, n_head=4),
                  "head-size-15": dict(hidden_size=60, n_layer=2, n_head=4)}


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("config", PROMPT_CONFIGS.values(), ids=PROMPT_CONFIGS.keys())
def test_one_call_prompt_attention_equals_the_op_by_op_one(isa, dtype, config):
    """Rows of 20, 7 and 13 real tokens padded to 20, in a cache of 40 slots: the same last-token
    logits (generation), logits at every real position (scoring) and keys/values in the real
    slots. (Pad positions differ: the one call leaves their attention at zero.)"""
    model, plan = accelerated(isa, dtype, **config)
    assert plan.prompt_attention
    ids, lengths = torch.randint(4, 1000, (3, 20)), torch.tensor([20, 7, 13])
    for prefill in (model.prefill, model.full_logits):
        one_call, reference_cache = model.allocate_cache(3, 40), model.allocate_cache(3, 40)
        ours = prefill(ids, lengths, one_call)
        reference = op_by_op(plan, lambda: prefill(ids, lengths, reference_cache))
        assert ours.shape == reference.shape and ours.dtype == dtype
        for row, length in enumerate(lengths.tolist()):  # pad positions' outputs are never used
            torch.testing.assert_close(ours[row, :length], reference[row, :length], **TOLERANCE[dtype])
            for mine, theirs in ((one_call.keys, reference_cache.keys), (one_call.values, reference_cache.values)):
                torch.testing.assert_close(mine[:, row, :, :length], theirs[:, row, :, :length], **TOLERANCE[dtype])
        last = (lambda t: t[torch.arange(3), lengths - 1]) if ours.dim() == 3 else (lambda t: t)  # [3, V]
        assert torch.equal(last(ours).argmax(-1), last(reference).argmax(-1))


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("config", PROMPT_CONFIGS.values(), ids=PROMPT_CONFIGS.keys())
def test_one_call_extend_attention_equals_the_op_by_op_one(isa, dtype, config):
    """Prompts continued after 16, 5 and 0 slots a prefix cache put in place (right-padded rests
    of 9, 3 and 9 real tokens), in a cache of 40 slots: the same last-token logits (generation),
    hidden states at every real position (scoring) and keys/values in the rows' real slots. Then
    a row whose padded rest runs past the cache's end."""
    model, plan = accelerated(isa, dtype, **config)
    assert plan.prompt_attention
    ids, starts, lengths = torch.randint(4, 1000, (3, 25)), torch.tensor([16, 5, 0]), torch.tensor([9, 3, 9])
    rest = torch.stack([ids[row, start:start + 9] for row, start in enumerate(starts.tolist())])  # [3, 9]

    def held(cache):  # the prefixes' slots, as a prefix cache's copy leaves them
        model.prefill(ids, starts.clamp(min=1), cache)
        return cache

    for extend in (lambda c: model.extend(rest, starts, lengths, c, 40),
                   lambda c: model.extend_hidden(rest, starts, c, 40)):
        one_call, reference_cache = held(model.allocate_cache(3, 40)), op_by_op(plan, lambda: held(model.allocate_cache(3, 40)))
        ours = extend(one_call)
        reference = op_by_op(plan, lambda: extend(reference_cache))
        assert ours.shape == reference.shape and ours.dtype == dtype
        if ours.dim() == 3:  # pad positions' outputs are never used
            for row, length in enumerate(lengths.tolist()):
                torch.testing.assert_close(ours[row, :length], reference[row, :length], **TOLERANCE[dtype])
        else:
            torch.testing.assert_close(ours, reference, **TOLERANCE[dtype])
            assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
            for mine, theirs in ((one_call.keys, reference_cache.keys), (one_call.values, reference_cache.values)):
                torch.testing.assert_close(mine[:, row, :, :start + length], theirs[:, row, :, :start + length],
                                           **TOLERANCE[dtype])
    # A rest padded past the end: its real tokens as op by op, the rest neither written nor attended.
    near_end = torch.tensor([35])
    one_call, reference_cache = model.allocate_cache(1, 40), model.allocate_cache(1, 40)
    ours = model.extend(rest[:1], near_end, torch.tensor([3]), one_call, 40)
    reference = op_by_op(plan, lambda: model.extend(rest[:1], near_end, torch.tensor([3]), reference_cache, 40))
    torch.testing.assert_close(ours, reference, **TOLERANCE[dtype])


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_the_step_refuses_positions_outside_the_cache(isa):
    model, plan = accelerated(isa, torch.float32, hidden_size=64, n_layer=2, n_head=4)
    cache = model.allocate_cache(1, 8)
    with pytest.raises(RuntimeError, match="position outside the cache"):
        plan.decode(torch.tensor([[5]]), torch.tensor([8]), cache, 8)
    with pytest.raises(RuntimeError, match="token id out of the vocabulary"):
        plan.decode(torch.tensor([[1024]]), torch.tensor([2]), cache, 8)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_one_call_steps_are_used_where_they_can_be(isa):
    def used(dtype=torch.float32, parallel=Parallel(), hidden_size=64, compile_steps=False, **options):
        needs_isa(isa)
        model = random_model(dtype, parallel, hidden_size=hidden_size, n_layer=2, n_head=4)
        plan = accelerate(model, CpuOptions(path=isa, **options), compile_steps=compile_steps)
        return plan.decode is not None, bool(plan.prompt_attention)

    assert used() == used(torch.bfloat16) == used(torch.float16) == (True, True)
    assert used(torch.bfloat16, hidden_size=48) == (False, True)  # 48 bf16 do not fill 64-byte loads
    assert used(compile_steps=True) == (False, True)  # torch.compile builds the decode step instead
    assert used(parallel=Parallel(rank=0, world_size=2)) == (False, True)  # all-reduces stay in Python
    assert used(one_call_steps=False) == (False, False)


@pytest.fixture
def amx_default_afterwards():
    """The kernels' AMX tiles back to the default (on, where this CPU has them) after the test: the
    setting is the process's, and the tests after it should run what a user's process runs."""
    yield
    if "avx512_bf16" in KERNEL_ISAS:
        accelerate(random_model(torch.bfloat16, hidden_size=64, n_layer=2, n_head=4), CpuOptions(path="avx512_bf16"))


@pytest.mark.parametrize("amx,tiles", [(False, False), (True, False), (True, True)],
                         ids=["no-amx", "amx-oneDNN", "amx-tiles"])
def test_many_rows_decode_op_by_op_where_amx_serves_them_better(amx, tiles, amx_default_afterwards, monkeypatch):
    """With AMX and the kernel's AMX products off, bf16 steps of more than 8 rows go op by op
    (oneDNN's products), fewer rows take the one-call step; with them on, the one-call step takes up
    to 80 rows and mixed steps up to 80 tokens. Other dtypes and CPUs keep 16; quantized weights keep
    their kernels' limits. Every path gives the same tokens. On a CPU without AMX tiles the tiles'
    case checks the routing alone: ``use_amx_tiles`` answers yes, and the kernel's AVX-512 loop
    computes what the tiles would."""
    import dataclasses
    import importlib

    from bloom_hpu.runtime.backends import Backend
    from bloom_hpu.runtime.cpu import capability
    from bloom_hpu.runtime.steps import StepRunner

    needs_isa("avx512_bf16")
    real = capability.detect()
    if tiles and not (real.amx and load("avx512_bf16").enable_amx(AMX_MIN_ROWS)):
        module = importlib.import_module("bloom_hpu.runtime.cpu.accelerate")  # the package's `accelerate` is the function
        monkeypatch.setattr(module, "use_amx_tiles", lambda kernels, wanted: wanted and kernels.isa == "avx512_bf16")
    monkeypatch.setattr(capability, "detect", lambda: dataclasses.replace(real, amx=amx))
    model = random_model(torch.bfloat16, hidden_size=64, n_layer=2, n_head=4)
    backend = Backend("cpu", cpu=CpuOptions(path="avx512_bf16", amx=tiles))
    runner = StepRunner(model, backend)
    plan = backend.cpu_plan
    assert (plan.decode_rows, plan.mixed_rows) == ((80, 80) if tiles else (8, 8) if amx else (16, 80))
    assert ("on AMX tiles" in plan.description) == tiles
    assert accelerate(random_model(torch.float32, hidden_size=64, n_layer=2, n_head=4),
                      CpuOptions(path="avx512_bf16", amx=tiles)).decode_rows == 16  # fp32: the kernel up to 16 rows
    # int8 weights: the one-call int8 step takes as many rows as the int8 kernel serves (bf16: the
    # VDPBF16PS path, as many as the bf16 step; fp32 on AVX-512: up to 32 rows, so the step's 16;
    # AVX2: as the bf16 step).
    from bloom_hpu.quantize import quantize

    for dtype, path, rows in ((torch.bfloat16, "avx512_bf16", 8 if amx else 16), (torch.float32, "avx512_bf16", 16),
                              (torch.bfloat16, "avx2", 8 if amx else 16), (torch.float32, "avx2", 16)):
        int8 = quantize(random_model(dtype, hidden_size=64, n_layer=2, n_head=4))
        assert accelerate(int8, CpuOptions(path=path, amx=tiles)).decode_rows == rows, (dtype, path)
    # int4: its kernel serves at least the rows of the one-call step on every build and dtype.
    for dtype, path in ((torch.bfloat16, "avx512_bf16"), (torch.float32, "avx512_bf16"), (torch.bfloat16, "avx2")):
        int4 = quantize(random_model(dtype, hidden_size=64, n_layer=2, n_head=4), "int4", 32)
        plan_int4 = accelerate(int4, CpuOptions(path=path, amx=tiles))
        assert plan_int4.decode_rows == (8 if amx and dtype == torch.bfloat16 else 16), (dtype, path)
        assert "one-call decode step (int4)" in plan_int4.description
    calls = []
    one_call = plan.decode
    plan.decode = lambda *args: calls.append(args[0].shape[0]) or one_call(*args)
    for rows in (8, 12):
        cache = model.allocate_cache(rows, 32)
        ids, lengths = torch.randint(4, 1000, (rows, 10)), torch.full((rows,), 10)
        logits = runner.prefill(ids, lengths, cache)
        tokens = logits.argmax(-1)
        ours = runner.decode(tokens[:, None], lengths, cache, 16)
        reference = op_by_op(plan, lambda: model.decode(tokens[:, None], lengths, cache, 16))
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert calls == ([8] if amx and not tiles else [8, 12])
