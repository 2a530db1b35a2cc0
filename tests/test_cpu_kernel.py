"""Our CPU kernel for products of a few rows (``bloom_hpu/cpu_kernel.py``): where this CPU has
AVX512-BF16 it must build, agree with an exact reference (bf16: to one rounding), and leave greedy
tokens those of transformers; where it cannot be had, bf16 falls back to oneDNN-packed weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bloom_hpu.runtime.cpu import kernels as cpu_kernel
from bloom_hpu.runtime.backends import Backend, oneDNN_packing_available

needs_kernel = pytest.mark.skipif(not (cpu_kernel.cpu_supports_bf16_dot() and cpu_kernel.compiler_found()),
                                  reason="CPU without AVX512-BF16, or no C++ compiler")


def bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps separate two bf16 tensors of the same sign pattern (elementwise)."""
    as_int = lambda t: t.view(torch.int16).to(torch.int32)
    return (as_int(a) - as_int(b)).abs()


def test_kernel_builds_where_the_cpu_can_run_it():
    kernel = cpu_kernel.load()
    if not cpu_kernel.cpu_supports_bf16_dot():
        assert kernel is None and "AVX512-BF16" in cpu_kernel.unavailable_reason()
    elif not cpu_kernel.compiler_found():
        assert kernel is None and "compiler" in cpu_kernel.unavailable_reason()
    else:
        assert kernel is not None, cpu_kernel.unavailable_reason()


ROWS = [1, 2, 3, 4, 5, 8, 13, 16]  # odd counts exercise the blocks of 4 input rows' remainders
SHAPES = [(1027, 64), (256, 96), (64, 1024)]  # 1027 outputs: the blocks of 4 weight rows' remainder


def random_product(rows, out_features, in_features, dtype):
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    return x, w, torch.randn(out_features, generator=generator).to(dtype)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_bf16_kernel_is_the_exact_product_rounded_once(rows, out_features, in_features):
    """Against the exact product rounded to bf16 once: equal, or one bf16 step away where the
    fp32 sums (another order of addition) straddle a rounding boundary."""
    kernel = cpu_kernel.load()
    x, w, bias = random_product(rows, out_features, in_features, torch.bfloat16)
    for b in (bias, None):
        exact = F.linear(x.double(), w.double(), None if b is None else b.double()).bfloat16()
        ours = cpu_kernel.linear(x, w, b, kernel)
        assert ours.shape == exact.shape and ours.dtype == torch.bfloat16
        apart = bf16_ulps_apart(ours, exact)
        assert apart.max() <= 1
        assert (apart == 0).float().mean() > 0.9


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_fp32_kernel_matches_the_exact_product(rows, out_features, in_features):
    kernel = cpu_kernel.load()
    x, w, bias = random_product(rows, out_features, in_features, torch.float32)
    for b in (bias, None):
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        ours = cpu_kernel.linear(x, w, b, kernel)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5 * in_features**0.5)


@needs_kernel
def test_kernel_serves_only_few_rows_of_whole_64_byte_steps():
    kernel = cpu_kernel.load()
    calls = []

    def counting(x, w, b):
        calls.append(tuple(x.shape))
        return kernel(x, w, b)

    w = torch.randn(48, 64).bfloat16()
    cpu_kernel.linear(torch.randn(2, 8, 64).bfloat16(), w, None, counting)  # 16 rows: the kernel
    cpu_kernel.linear(torch.randn(17, 64).bfloat16(), w, None, counting)  # 17 rows: oneDNN
    cpu_kernel.linear(torch.randn(1, 48).bfloat16(), torch.randn(8, 48).bfloat16(), None, counting)  # K=48
    cpu_kernel.linear(torch.randn(1, 48), torch.randn(8, 48), None, counting)  # fp32: K=48 fills 3 loads
    cpu_kernel.linear(torch.randn(1, 64).half(), torch.randn(8, 64).half(), None, counting)  # fp16: never
    assert calls == [(2, 8, 64), (1, 48)]  # leading dimensions kept: the kernel takes x [..., K]

    # A block's Linear decides about its weight once, then routes by the row count alone.
    from bloom_hpu.model import Linear

    calls.clear()
    linear = Linear(64, 48).bfloat16().requires_grad_(False)
    assert linear.use_few_rows(counting)
    linear(torch.randn(16, 64).bfloat16())
    linear(torch.randn(17, 64).bfloat16())
    assert calls == [(16, 64)]
    assert not Linear(48, 8).bfloat16().use_few_rows(counting)  # K=48 does not suit it


@needs_kernel
def test_the_operator_refuses_what_it_cannot_compute():
    """Called directly (the model never does this), the operator says why rather than computing garbage."""
    kernel = cpu_kernel.load()
    with pytest.raises(RuntimeError, match="bf16 or fp32 only"):
        kernel(torch.ones(1, 64, dtype=torch.float16), torch.ones(8, 64, dtype=torch.float16), None)
    with pytest.raises(RuntimeError, match="K must be a multiple of 64 bytes"):
        kernel(torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(8, 48, dtype=torch.bfloat16), None)
    assert kernel(torch.ones(1, 64), torch.ones(8, 64), None).shape == (1, 8)  # 64 fp32 = four 64-byte steps


def test_bf16_model_on_cpu_uses_the_kernel_or_packs(make_ckpt):
    """Greedy tokens of our bf16 generator (kernel, or oneDNN packing where there is none) equal
    transformers' bf16 ``generate``."""
    import transformers

    from generation.generator import Generator

    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    generator = Generator.from_pretrained(folder, dtype="bf16")
    mlp = generator.model.h[0].mlp.dense_h_to_4h
    if cpu_kernel.load() is not None:
        assert generator.backend.fast_path == "few-rows kernel; one C++ call: decode step, prompt attention"
        assert mlp.few_rows is not None and generator.model.few_rows is not None and mlp.packed is None
    else:
        assert generator.backend.fast_path.startswith("oneDNN packed weights")
        assert mlp.packed is not None
    reference = transformers.BloomForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    for prompt in ("It was the best of times", "Hello, world"):
        prompt_ids = generator.tokenizer.encode(prompt)
        with torch.no_grad():
            hf = reference.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                    max_length=24, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert generator.generate(prompt, max_length=24)[0].token_ids == hf[0, len(prompt_ids):].tolist()


def test_kernel_can_be_turned_off(monkeypatch):
    """BLOOM_CPU_KERNEL=0: no kernel, and a reason to show."""
    monkeypatch.setattr(cpu_kernel, "_loaded", None)
    monkeypatch.setattr(cpu_kernel, "_reason", None)
    monkeypatch.setenv("BLOOM_CPU_KERNEL", "0")
    assert cpu_kernel.load() is None
    assert "BLOOM_CPU_KERNEL=0" in cpu_kernel.unavailable_reason()


def test_other_dtypes_keep_pytorch_kernels(make_ckpt):
    from bloom_hpu.loading import load_model

    model, _ = load_model(make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7), torch.float16)
    backend = Backend("cpu")
    backend.prepare_model(model)
    assert backend.fast_path == "none" and model.few_rows is None


def test_cli_says_which_cpu_fast_path_it_uses(tiny_checkpoint, capsys):
    import bloom

    assert bloom.main(["--weights", str(tiny_checkpoint), "--max_length", "12", "--quiet", "Hello"]) == 0
    err = capsys.readouterr().err
    if cpu_kernel.load() is not None:
        assert "CPU fast path: few-rows kernel; one C++ call: decode step, prompt attention" in err
    else:
        assert "CPU fast path" not in err  # the embedded checkpoint is fp32: nothing to pack
    assert bloom.main(["--weights", str(tiny_checkpoint), "--max_length", "12", "--quiet", "--mode", "vanilla",
                       "Hello"]) == 0
    assert "CPU fast path" not in capsys.readouterr().err


@pytest.mark.skipif(not oneDNN_packing_available(), reason="torch build without oneDNN's linear ops")
@pytest.mark.parametrize("packed", [False, True])
def test_gelu_fused_into_onednn_product_is_gelu_of_the_product(packed):
    """Prefill-sized inputs (more than FEW_ROWS rows) of an MLP's first linear with ``fuse_gelu``:
    the GELU of the exact product, rounded once, within one bf16 step; the unfused path, which
    rounds the product and then the GELU, is no closer."""
    from bloom_hpu.model import Linear

    torch.manual_seed(0)
    linear = Linear(64, 256).bfloat16().requires_grad_(False)
    x = torch.randn(2, 24, 64).bfloat16()
    exact = F.gelu(F.linear(x.double(), linear.weight.double(), linear.bias.double()), approximate="tanh").bfloat16()
    unfused = linear.forward_gelu(x)
    linear.fuse_gelu = True
    if packed:
        linear.pack()
    fused = linear.forward_gelu(x)
    assert fused.shape == (2, 24, 256) and fused.dtype == torch.bfloat16
    assert bf16_ulps_apart(fused, exact).max() <= 1
    assert bf16_ulps_apart(unfused, exact).max() >= 1


def test_bf16_generator_fuses_the_gelu_where_onednn_can(make_ckpt):
    from generation.generator import Generator

    generator = Generator.from_pretrained(make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7), dtype="bf16")
    assert generator.model.h[1].mlp.dense_h_to_4h.fuse_gelu == oneDNN_packing_available()


@needs_kernel
def test_only_weights_that_suit_the_kernel_use_it(make_ckpt):
    """bf16 with hidden 48: 48 elements do not fill whole 64-byte loads, 4 x 48 = 192 do; so of each
    block only dense_4h_to_h (K = 192) takes the kernel, and not the LM head (K = 48)."""
    from bloom_hpu.loading import load_model

    model, _ = load_model(make_ckpt(hidden_size=48, n_layer=2, n_head=4, seed=3), torch.bfloat16)
    assert model.use_few_rows_kernel(cpu_kernel.load()) == 2
    assert model.few_rows is None and model.h[0].mlp.dense_h_to_4h.few_rows is None
    assert model.h[0].mlp.dense_4h_to_h.few_rows is not None
    ids, lengths = torch.randint(5, 500, (1, 6)), torch.tensor([6])
    with torch.no_grad():  # still runs end to end, both paths mixed
        logits = model.prefill(ids, lengths, model.allocate_cache(1, 8))
        logits = model.decode(logits.argmax(-1)[:, None], lengths, model.allocate_cache(1, 8), 8)
    assert logits.shape == (1, model.config.vocab_size) and torch.isfinite(logits).all()
