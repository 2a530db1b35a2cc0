"""The CPU fast paths (``bloom_hpu/runtime/cpu/``): which one runs is detected, never assumed; our
few-rows products agree with an exact reference for each ISA build this CPU can run (an AVX-512
CPU runs the AVX2 build too) and each dtype; every path, the PyTorch-only one included, leaves
greedy tokens those of transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from bloom_hpu.runtime.cpu import CpuOptions, CpuPathError, accelerate, capability
from bloom_hpu.runtime.cpu.kernels import compiler_found, load
from bloom_hpu.runtime.cpu.layers import AMX_MIN_ROWS, CpuLinear, CpuTiedHead, KernelGelu, OneCallPromptAttention

from isas import ALL_KERNEL_ISAS, KERNEL_ISAS, ROOT, needs_amx_tiles, needs_isa

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many steps of a 16-bit float separate two tensors of the same sign pattern (elementwise)."""
    as_int = lambda t: t.view(torch.int16).to(torch.int32)  # noqa: E731
    return (as_int(a) - as_int(b)).abs()


def test_capability_is_detected_from_the_cpu_and_capped_by_torch():
    cap = capability.detect()
    flags = capability.cpu_flags() or set()
    assert cap.isa in ("avx512_bf16", "avx512", "avx2", "other") and cap.why
    if cap.isa == "avx512_bf16":
        assert {"avx512_bf16", "avx512bw", "avx512vl"} <= flags
        assert torch.backends.cpu.get_cpu_capability() == "AVX512"
    if cap.isa in ("avx2", "avx512"):
        assert {"avx2", "fma", "f16c"} <= flags


def test_a_cpu_capped_at_avx2_by_torch_is_taken_as_avx2():
    """``ATEN_CPU_CAPABILITY=avx2`` (PyTorch's own switch) makes an AVX-512 CPU an AVX2 one, for our
    choice too: how this suite runs the AVX2 machine's path on any AVX2+ machine."""
    code = "from bloom_hpu.runtime.cpu import capability; print(capability.detect().isa)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    flags = capability.cpu_flags() or set()
    assert out.stdout.strip() == ("avx2" if {"avx2", "fma", "f16c"} <= flags else "other")


ROWS = [1, 2, 3, 4, 5, 8, 13, 16]  # odd counts exercise the blocks of 4 input rows' remainders
SHAPES = [(1027, 64), (256, 96), (64, 1024)]  # 1027 outputs: the blocks of 4 weight rows' remainder


def random_product(rows, out_features, in_features, dtype):
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    return x, w, torch.randn(out_features, generator=generator).to(dtype)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_16_bit_products_are_the_exact_product_rounded_once(isa, dtype, rows, out_features, in_features):
    """Against the exact product rounded once: almost always equal; elsewhere within one rounding
    step plus the error of an fp32 sum (relative to the sum of |x w| terms: near zero, large terms
    cancel and any fp32 order of addition, PyTorch's included, lands some fp16 steps away)."""
    needs_isa(isa)
    kernel = load(isa).few_rows_linear
    x, w, bias = random_product(rows, out_features, in_features, dtype)
    step = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for b in (bias, None):
        exact64 = F.linear(x.double(), w.double(), None if b is None else b.double())
        exact = exact64.to(dtype)
        ours = kernel(x, w, b)
        assert ours.shape == exact.shape and ours.dtype == dtype
        terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
        bound = step * exact64.abs() + in_features * 2.0**-24 * terms + 1e-30
        assert ((ours.double() - exact64).abs() <= bound).all()
        assert (ulps_apart(ours, exact) == 0).float().mean() > 0.9


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(isa, dtype):
    """Each row of a call of 1 to 40 rows (210 for rows of 2560) gets the bits it gets alone: the
    loop over a few rows and the one for many (on AVX2, 16-bit weights widened once per call into
    fp32 scratch, a chunk of columns at a time where x outgrows L2, its sums carried from chunk to
    chunk) make the same FMAs in the same order. Speculation's verify pass and a batch's rows rely
    on it."""
    needs_isa(isa)
    kernel = load(isa).few_rows_linear
    generator = torch.Generator().manual_seed(3)
    for n, k, most in ((1027, 64, 40), (36, 4096, 40), (13, 2560, 210)):
        # The first 20 rows' products are exactly 0 (w = [a, -a], x = [b, b]): what comes out is the
        # fp32 sums' rounding, which any other order of the same FMAs changes. The others random.
        a = torch.randn(n, k // 2, generator=generator)
        w = torch.cat([a, -a], dim=1).to(dtype)
        b = torch.randn(20, k // 2, generator=generator)
        x = torch.cat([torch.cat([b, b], dim=1), torch.randn(most - 20, k, generator=generator)]).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype) / 1024
        alone = torch.cat([kernel(x[i: i + 1], w, bias) for i in range(most)])
        for rows in (2, 5, 6, 7, 16, 40, most):
            assert torch.equal(kernel(x[:rows], w, bias), alone[:rows]), (k, rows)


@pytest.mark.parametrize("rows", [4, 5, 16, 17, 33, 80, 130])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_bf16_products_on_amx_tiles_are_the_exact_product_rounded_once(rows, out_features, in_features):
    """The kernel's bf16 products of 4 rows or more on AMX tiles (csrc/amx_rows.h; a CPU with AMX
    only): as the AVX-512 loop's, the exact product rounded once, to the same bounds, and so within
    twice those of the loop's own result. Rows past 16 and 32 take more input
    blocks and passes; 1027 outputs leave 3 rows past the tiles' 16, for the loop."""
    kernels = needs_amx_tiles()
    x, w, bias = random_product(rows, out_features, in_features, torch.bfloat16)
    step = 2.0**-8
    for b in (bias, None):
        exact64 = F.linear(x.double(), w.double(), None if b is None else b.double())
        ours = kernels.few_rows_linear(x, w, b)
        terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
        bound = step * exact64.abs() + in_features * 2.0**-24 * terms + 1e-30
        assert ours.shape == exact64.shape and ((ours.double() - exact64).abs() <= bound).all()
        assert (ulps_apart(ours, exact64.to(torch.bfloat16)) == 0).float().mean() > 0.9
        kernels.enable_amx(0)
        try:
            loop = kernels.few_rows_linear(x, w, b)
        finally:
            kernels.enable_amx(AMX_MIN_ROWS)
        assert ((ours.double() - loop.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_fp32_products_match_the_exact_product(isa, rows, out_features, in_features):
    needs_isa(isa)
    kernel = load(isa).few_rows_linear
    x, w, bias = random_product(rows, out_features, in_features, torch.float32)
    for b in (bias, None):
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        ours = kernel(x[None], w, b)[0]  # leading dimensions kept: the kernel takes x [..., K]
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5 * in_features**0.5)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_weight_prefetch_gives_the_same_bits(isa, dtype):
    """How the few-rows products (float, int8, int4, integer) prefetch weights (not at all, L1 along
    the rows, or L2 the next block) moves no bit of their results, for rows narrower and wider than
    a prefetch's reach; a kind or weight format other than the three is refused; the process's
    kinds are the CPU's (``capability.weight_prefetch``)."""
    needs_isa(isa)
    kernels = load(isa)
    chosen = capability.PREFETCH_KINDS[capability.weight_prefetch()]
    formats = sorted(set(capability.PREFETCH_FORMATS.values()))
    torch.manual_seed(5)
    try:
        for rows, (n, k) in ((1, (260, 1024)), (5, (36, 4096)), (17, (12, 64))):
            x, w, bias = (torch.randn(rows, k) / 8).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
            q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            q4, s4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // 32) / 50
            s8 = torch.rand(n) / 50
            products = (lambda: kernels.few_rows_linear(x, w, bias),
                        lambda: kernels.int8_rows_linear(x, q8, s8, bias),
                        lambda: kernels.int4_rows_linear(x, q4, s4, bias),
                        lambda: kernels.block_q8_linear(x, q8, s8, bias),  # integer products
                        lambda: kernels.block_q8_linear(x, q4, s4, bias))
            for product in products:
                for fmt in formats:
                    assert kernels.set_prefetch(1, fmt) == 1
                along_rows = product()
                for kind in (2, 0):
                    for fmt in formats:
                        assert kernels.set_prefetch(kind, fmt) == kind
                    assert torch.equal(along_rows, product())
        with pytest.raises(RuntimeError, match="kind 0, 1 or 2"):
            kernels.set_prefetch(3, 0)
        with pytest.raises(RuntimeError, match="format 0, 1 or 2"):
            kernels.set_prefetch(1, 3)
    finally:
        for fmt in formats:
            kernels.set_prefetch(chosen, fmt)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_the_weight_prefetch_is_set_from_a_row_count_up(isa):
    """``set_prefetch(kind, format, from_rows)`` sets the kind of the products of from_rows input
    rows and more (whole row classes: the class holding from_rows and those above it), leaving
    fewer rows and the other formats as they were; from_rows 1 sets every count."""
    needs_isa(isa)
    kernels = load(isa)
    classes = list(kernels.prefetch_row_classes())
    chosen = capability.PREFETCH_KINDS[capability.weight_prefetch()]
    counts = range(1, 2 * classes[-1] + 1)
    try:
        for fmt in (0, 1, 2):
            assert kernels.set_prefetch(0, fmt) == 0
        assert kernels.set_prefetch(2, 0, classes[1]) == 2
        assert kernels.set_prefetch(1, 0, classes[-1]) == 1
        assert [kernels.prefetch_in_force(0, n) for n in counts] == \
            [0 if n < classes[1] else 2 if n < classes[-1] else 1 for n in counts]
        assert all(kernels.prefetch_in_force(fmt, n) == 0 for fmt in (1, 2) for n in counts)
        assert kernels.set_prefetch(2, 0) == 2 and all(kernels.prefetch_in_force(0, n) == 2 for n in counts)
        with pytest.raises(RuntimeError, match="from_rows 1 or more"):
            kernels.set_prefetch(1, 0, 0)
        with pytest.raises(RuntimeError, match="rows 1 or more"):
            kernels.prefetch_in_force(0, 0)
    finally:
        for fmt in (0, 1, 2):
            kernels.set_prefetch(chosen, fmt)


def test_the_weight_prefetch_follows_the_vendor_unless_forced(monkeypatch):
    monkeypatch.delenv(capability.PREFETCH_ENV, raising=False)
    monkeypatch.setattr(capability, "cpu_vendor", lambda: "AuthenticAMD")
    assert capability.weight_prefetch() == "l2"
    monkeypatch.setattr(capability, "cpu_vendor", lambda: "GenuineIntel")
    assert capability.weight_prefetch() == "l1"
    monkeypatch.setenv(capability.PREFETCH_ENV, "L2")
    assert capability.weight_prefetch() == "l2"
    monkeypatch.setenv(capability.PREFETCH_ENV, "none")
    assert capability.weight_prefetch() == "none"
    monkeypatch.setenv(capability.PREFETCH_ENV, "far")
    with pytest.raises(ValueError, match="choose none, l1, l2"):
        capability.weight_prefetch()


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_the_sampling_noise_kernel_makes_the_bits_of_sampling_uniform(isa):
    """counter_uniform is sampling.uniform's noise, bit for bit: every width (ragged, one task,
    several), rows, steps as an int, one per batch and one per row, keys across [0, 2**31)."""
    from generation.search.sampling import checked_uniform_kernel, uniform

    needs_isa(isa)
    kernel = load(isa).counter_uniform
    keys = torch.tensor([0, 1, 2, 99, 12345, (1 << 31) - 1, 1 << 30, 777], dtype=torch.long)
    for rows, n in [(1, 1), (3, 100), (8, 2048), (8, 2049), (5, 5000), (2, 250880)]:
        for step in (0, 41, torch.tensor([9]), torch.arange(rows) * 3):
            assert torch.equal(uniform(keys[:rows], step, n, kernel), uniform(keys[:rows], step, n))
    assert uniform(keys, 3, 0, kernel).shape == (8, 0)
    assert checked_uniform_kernel(kernel) is kernel
    assert checked_uniform_kernel(lambda base, n: kernel(base, n) * 0.999) is None  # a wrong kernel is refused
    with pytest.raises(RuntimeError, match=r"base values in \[0, 2\*\*31\)"):
        kernel(torch.tensor([1 << 31]), 4)
    with pytest.raises(RuntimeError, match=r"base \[R\] int64"):
        kernel(torch.zeros(2, 2, dtype=torch.long), 4)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_the_operator_refuses_what_it_cannot_compute(isa):
    """Called directly (the model never does this), the operator says why rather than computing garbage."""
    needs_isa(isa)
    kernel = load(isa).few_rows_linear
    with pytest.raises(RuntimeError, match="bf16, fp16 or fp32 only"):
        kernel(torch.ones(1, 64, dtype=torch.float64), torch.ones(8, 64, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="K must be a multiple of 64 bytes"):
        kernel(torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(8, 48, dtype=torch.bfloat16), None)
    assert kernel(torch.ones(1, 64), torch.ones(8, 64), None).shape == (1, 8)  # 64 fp32 = four 64-byte steps


def test_a_linear_routes_few_rows_to_the_kernel_and_the_rest_to_pytorch(make_ckpt):
    from bloom_hpu.loading import load_model

    model, _ = load_model(make_ckpt(hidden_size=64, n_layer=1, n_head=4, seed=7), torch.bfloat16)
    calls = []
    accelerate(model, CpuOptions(path="plain"))
    linear = model.h[0].mlp.dense_4h_to_h
    linear.kernel, linear.few_rows_limit = (lambda x, w, b: calls.append(tuple(x.shape)) or F.linear(x, w, b)), 16 * 256
    linear(torch.randn(2, 8, 256).bfloat16())  # 16 rows: the kernel
    linear(torch.randn(17, 256).bfloat16())  # 17 rows: PyTorch
    assert calls == [(2, 8, 256)]


PATHS = ["auto", *ALL_KERNEL_ISAS, "onednn", "plain"]


def expected_pieces(path: str, dtype: torch.dtype) -> dict:
    kernels = path in ("avx512_bf16", "avx2") or (path == "auto" and capability.detect().kernel_isa is not None
                                                  and compiler_found())
    return {"kernels": kernels, "packed": not kernels and path != "plain" and dtype == torch.bfloat16
            and capability.onednn_packs(dtype)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("path", PATHS)
def test_every_path_gives_transformers_greedy_tokens(make_ckpt, path, dtype):
    """Greedy tokens of our generator on each CPU path equal transformers' ``generate`` in the same
    dtype; each path uses what it says, and the load line says it."""
    import transformers

    from generation.generator import Generator

    if path in ("avx512_bf16", "avx2"):
        needs_isa(path)
    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    generator = Generator.from_pretrained(folder, dtype=dtype, cpu=CpuOptions(path=path))
    model, plan = generator.model, generator.backend.cpu_plan
    want = expected_pieces(path, dtype)
    mlp = model.h[0].mlp.dense_h_to_4h
    assert isinstance(mlp, CpuLinear)
    assert (mlp.kernel is not None) == want["kernels"] == (plan.kernels is not None)
    assert isinstance(model.head, CpuTiedHead) == want["kernels"]
    assert (plan.decode is not None) == want["kernels"]
    assert isinstance(model.h[0].self_attention, OneCallPromptAttention) == want["kernels"]
    assert (mlp.packed is not None) == want["packed"]
    # The MLP's GELU: inside oneDNN's product where fused; else the kernels' threaded one in bf16 and
    # fp16; fp32 keeps ATen's, the reference's own.
    gelu = model.h[0].mlp.gelu
    if getattr(mlp, "fused_gelu", False):
        assert isinstance(gelu, torch.nn.Identity)
    else:
        assert isinstance(gelu, KernelGelu) == (want["kernels"] and dtype != torch.float32)
    assert ("threaded GELU" in plan.description) == isinstance(gelu, KernelGelu)
    if want["kernels"]:
        assert plan.description.startswith(capability.ISA_NAMES[plan.kernels.isa] + " kernels")
    else:
        assert plan.description.startswith("PyTorch operations")
    reference = transformers.BloomForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()
    for prompt in ("It was the best of times", "Hello, world"):
        prompt_ids = generator.tokenizer.encode(prompt)
        with torch.no_grad():
            hf = reference.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                    max_length=24, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert generator.generate(prompt, max_length=24)[0].token_ids == hf[0, len(prompt_ids):].tolist()


def test_a_path_this_cpu_cannot_run_is_refused_with_a_reason(make_ckpt):
    from generation.generator import Generator

    with pytest.raises(CpuPathError, match="unknown CPU path 'avx3'"):
        CpuOptions(path="avx3")
    cap = capability.detect()
    refused = [isa for isa in ("avx512_bf16", "avx2") if not cap.can_run(isa)]
    for isa in refused:
        with pytest.raises(CpuPathError, match=f"CPU path {isa} cannot run on this CPU"):
            Generator.from_pretrained(make_ckpt(hidden_size=64, n_layer=1, n_head=4), cpu=CpuOptions(path=isa))


def test_only_weights_that_suit_the_kernel_use_it(make_ckpt):
    """bf16 with hidden 48: 48 elements do not fill whole 64-byte loads, 4 x 48 = 192 do; so of each
    block only dense_4h_to_h (K = 192) takes the kernel, not the LM head (K = 48), and the decode
    step stays op by op (it needs every product in the kernel)."""
    if not KERNEL_ISAS:
        pytest.skip("no kernel build runs on this CPU")
    from bloom_hpu.loading import load_model

    model, _ = load_model(make_ckpt(hidden_size=48, n_layer=2, n_head=4, seed=3), torch.bfloat16)
    plan = accelerate(model, CpuOptions(path=KERNEL_ISAS[-1]))
    assert plan.decode is None and not isinstance(model.head, CpuTiedHead)
    assert model.h[0].mlp.dense_h_to_4h.kernel is None and model.h[0].mlp.dense_4h_to_h.kernel is not None
    ids, lengths = torch.randint(5, 500, (1, 6)), torch.tensor([6])
    with torch.no_grad():  # still runs end to end, both paths mixed
        logits = model.prefill(ids, lengths, model.allocate_cache(1, 8))
        logits = model.decode(logits.argmax(-1)[:, None], lengths, model.allocate_cache(1, 8), 8)
    assert logits.shape == (1, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.skipif(not capability.onednn_fuses_gelu(torch.bfloat16), reason="oneDNN cannot fuse a bf16 GELU here")
@pytest.mark.parametrize("packed", [False, True])
def test_gelu_fused_into_onednn_product_is_gelu_of_the_product(packed):
    """Prefill-sized inputs (more than 16 rows) of an MLP's first linear with ``fused_gelu``: the
    GELU of the exact product, rounded once, within one bf16 step; the unfused path, which rounds
    the product and then the GELU, is no closer."""
    from bloom_hpu.model import Linear
    from bloom_hpu.runtime.cpu.layers import swap

    torch.manual_seed(0)
    linear = Linear(64, 256).bfloat16().requires_grad_(False)
    x = torch.randn(2, 24, 64).bfloat16()
    exact = F.gelu(F.linear(x.double(), linear.weight.double(), linear.bias.double()), approximate="tanh").bfloat16()
    unfused = F.gelu(linear(x), approximate="tanh")
    swap(linear, CpuLinear, fused_gelu=True)
    if packed:
        if not capability.onednn_packs(torch.bfloat16):
            pytest.skip("oneDNN cannot pack bf16 weights here")
        linear.pack()
    fused = linear(x)
    assert fused.shape == (2, 24, 256) and fused.dtype == torch.bfloat16
    assert ulps_apart(fused, exact).max() <= 1
    assert ulps_apart(unfused, exact).max() >= 1


def test_cli_says_which_cpu_path_it_uses(tiny_checkpoint, capsys):
    import bloom

    assert bloom.main(["--weights", str(tiny_checkpoint), "--max_length", "12", "--quiet", "Hello"]) == 0
    err = capsys.readouterr().err
    assert "CPU fast path: " in err
    assert bloom.main(["--weights", str(tiny_checkpoint), "--max_length", "12", "--quiet", "--cpu_path", "plain",
                       "Hello"]) == 0
    assert "CPU fast path: PyTorch operations (--cpu_path plain)" in capsys.readouterr().err
    assert bloom.main(["--weights", str(tiny_checkpoint), "--max_length", "12", "--quiet", "--mode", "vanilla",
                       "Hello"]) == 0
    assert "CPU fast path" not in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_cli_runs_every_dtype_as_on_an_avx2_cpu(tiny_checkpoint, dtype):
    """PyTorch itself capped at AVX2 (its ATen kernels and oneDNN's), as on an AVX2-only CPU: where
    oneDNN refuses bf16 packing and fused GELU there, the probes see it, and nothing crashes."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, str(ROOT / "bloom.py"), "--weights", str(tiny_checkpoint), "--dtype", dtype,
                           "--max_length", "16", "Hello"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    if "avx2" in KERNEL_ISAS:
        assert "CPU fast path: AVX2 kernels" in proc.stderr
