"""Prompts on a CPU whose bf16 products are emulated (AVX2; AVX-512 without BF16): the products of
many rows over bf16/fp16, int8 and int4 weights run as fp32 products on the widened weight
(``WidenedProducts``, ``runtime/cpu/layers.py``), chosen from the detected capability only.

The products against the exact product of the same (dequantized) weights; the routing (only many
rows, only where bf16 is emulated, the decode's few rows untouched); and a whole prefill on that
route against transformers on the same (dequantized) weights. This CPU is made to look like an
AVX2 one by replacing ``capability.detect``; a subprocess under ``ATEN_CPU_CAPABILITY=avx2`` checks
that PyTorch's own switch gives the same choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from bloom_hpu.int4 import dequantized_int4, group_scales, quantize_groups
from bloom_hpu.loading import load_model
from bloom_hpu.quantize import dequantized, quantize
from bloom_hpu.runtime.cpu import CpuOptions, accelerate, capability
from bloom_hpu.runtime.cpu.layers import FEW_ROWS, WidenedProducts
from dequantized import write_dequantized
from isas import KERNEL_ISAS

ROOT = Path(__file__).resolve().parent.parent
AVX2_CPU = capability.Capability("avx2", "a test: as an AVX2 CPU")
# The paths that widen on such a CPU: without kernels (public ops alone), and the AVX2 build.
PATHS = ["onednn"] + (["avx2"] if "avx2" in KERNEL_ISAS else [])


@pytest.fixture
def as_avx2(monkeypatch):
    monkeypatch.setattr(capability, "detect", lambda: AVX2_CPU)


def test_bf16_is_emulated_on_avx2_and_avx512_cpus_only(monkeypatch):
    assert capability.Capability("avx2", "").emulates_bf16 and capability.Capability("avx512", "").emulates_bf16
    assert not capability.Capability("other", "").emulates_bf16
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert not capability.Capability("avx512_bf16", "").emulates_bf16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # oneDNN capped below its bf16 products
    assert capability.Capability("avx512_bf16", "").emulates_bf16


def test_pytorchs_avx2_switch_makes_bf16_emulated():
    code = "from bloom_hpu.runtime.cpu import capability; print(capability.detect().emulates_bf16)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    flags = capability.cpu_flags() or set()
    assert out.stdout.strip() == str({"avx2", "fma", "f16c"} <= flags)


def test_onednns_cap_below_amx_turns_our_tiles_off_too():
    code = "from bloom_hpu.runtime.cpu import capability; c = capability.detect(); print(c.isa, c.amx)"
    flags = capability.cpu_flags() or set()
    for cap, amx in (("", "amx_bf16" in flags), ("AVX512_CORE_BF16", False), ("avx2", False)):
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[1] == str(amx and out.stdout.split()[0] == "avx512_bf16"), (cap, out.stdout)


def inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
            torch.randn(n, generator=g).to(dtype))


def assert_rounded_once(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` is ``exact`` (fp64) rounded to ``dtype``, give or take one step and an fp32 sum's error."""
    assert got.dtype == dtype and got.shape == exact.shape
    step = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    torch.testing.assert_close(got.double(), exact, rtol=step, atol=1e-5 * exact.abs().max().item())


# (rows, outputs, inputs, fp32 weights per panel): one panel, and several with a remainder
SHAPES = [(17, 48, 64, 1 << 24), (40, 100, 96, 96 * 7), (33, 1027, 64, 64 * 300)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, n, k, panel", SHAPES)
def test_widened_float_products_are_the_exact_product_rounded_once(dtype, m, n, k, panel):
    wide = WidenedProducts(panel_elements=panel)
    x, w, b = inputs(m, n, k, dtype, seed=n)
    for bias in (b, None):
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert_rounded_once(wide.linear(x, w, bias), exact, dtype)
    gelu = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    assert_rounded_once(wide.linear(x, w, b, gelu=True), gelu, dtype)
    # [B, S, K] inputs keep their leading shape
    assert wide.linear(x.view(1, m, k), w, b).shape == (1, m, n)


@pytest.mark.parametrize("kernels", [False] + (["avx2"] if "avx2" in KERNEL_ISAS else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m, n, k, panel", SHAPES)
def test_widened_quantized_products_are_those_of_the_dequantized_weights(kernels, dtype, m, n, k, panel):
    """int8: x @ (q * scale) with the scales on the product's columns; int4: x @ the weight
    dequantized in fp32 (as the AVX2 int4 kernel's sums use it); both rounded once to x's dtype."""
    from bloom_hpu.runtime.cpu.kernels import load

    wide = WidenedProducts(load(kernels).int4_dequantize if kernels else None, panel_elements=panel)
    x, w, bias = inputs(m, n, k, dtype, seed=k)
    g = torch.Generator().manual_seed(m)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s8 = torch.rand(n, generator=g) / 100
    s4 = group_scales(w.float(), 32)
    q4 = quantize_groups(w.float(), s4)
    for q, scales, weight in ((q8, s8, dequantized(q8, s8).double()),
                              (q4, s4, dequantized_int4(q4, s4).double())):
        exact = F.linear(x.double(), weight, bias.double())
        got = wide.quantized(x, q, scales, bias)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
        else:
            assert_rounded_once(got, exact, dtype)


def small_model(dtype, mode=None):
    from bloom_hpu.config import BloomConfig
    from bloom_hpu.model import StaticBloom
    from utils.random_checkpoint import random_weights

    config = BloomConfig(vocab_size=1024, hidden_size=64, n_layer=2, n_head=4)
    model = StaticBloom(config)
    model.load_state_dict(random_weights(config, live_vocab=1000, seed=4, weight_scale=1.0))
    model = model.to(dtype).eval().requires_grad_(False)
    return quantize(model, mode, 32 if mode == "int4" else None) if mode else model


class Spy:
    """Wraps a product (a kernel, or ``WidenedProducts``' methods) and counts the rows it took."""

    def __init__(self, fn):
        self.fn, self.rows = fn, []

    def __call__(self, x, *args, **kwargs):
        self.rows.append(x.numel() // x.shape[-1])
        return self.fn(x, *args, **kwargs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_only_many_rows_are_widened_and_the_decode_keeps_its_route(as_avx2, path, mode):
    model = small_model(torch.bfloat16, mode)
    plan = accelerate(model, CpuOptions(path=path))
    assert "weights widened" in plan.description
    linear = model.h[0].mlp.dense_4h_to_h
    wide = linear.wide
    assert wide is not None and all(b.self_attention.query_key_value.wide is wide for b in model.h)
    if path != "onednn":
        assert (plan.decode_rows, plan.mixed_rows) == (FEW_ROWS, 48 if mode else 80)  # as before
    spies = {"wide": Spy(wide.quantized if mode else wide.linear)}
    if mode:
        wide.quantized = spies["wide"]
    else:
        wide.linear = spies["wide"]
    if linear.kernel is not None:
        spies["kernel"] = linear.kernel = Spy(linear.kernel)
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, 128):
        linear(torch.randn(rows, linear.in_features).bfloat16())
    assert spies["wide"].rows == [FEW_ROWS + 1, 128]
    if "kernel" in spies:
        assert spies["kernel"].rows == [1, FEW_ROWS]


@pytest.mark.parametrize("case", ["avx512_bf16", "fp32", "widen off", "plain"])
def test_nothing_is_widened_where_bf16_is_native_or_not_asked_for(monkeypatch, case):
    cpu = capability.Capability("avx512_bf16", "a test") if case == "avx512_bf16" else AVX2_CPU
    monkeypatch.setattr(capability, "detect", lambda: cpu)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    model = small_model(torch.float32 if case == "fp32" else torch.bfloat16, "int8")
    options = CpuOptions(path="plain" if case == "plain" else "onednn", widen=case != "widen off")
    plan = accelerate(model, options)
    assert "widened" not in plan.description
    assert all(getattr(m, "wide", None) is None for m in model.modules())
    if case == "fp32":
        return
    # a second call that widens, then one that does not: the first choice does not linger
    model = small_model(torch.bfloat16)
    monkeypatch.setattr(capability, "detect", lambda: AVX2_CPU)
    accelerate(model, CpuOptions(path="onednn"))
    assert model.h[0].mlp.dense_h_to_4h.wide is not None
    monkeypatch.setattr(capability, "detect", lambda: cpu)
    accelerate(model, options)
    assert all(getattr(m, "wide", None) is None for m in model.modules())


@pytest.fixture(scope="module")
def folder(seed7_checkpoint):
    return seed7_checkpoint


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_a_widened_prefill_is_transformers_on_the_same_weights(as_avx2, folder, tmp_path, path, dtype, mode):
    """Prompts of 40 and 23 tokens (with a pad row: products of 80 rows) through the widened
    products: the last token's logits are transformers' on the same (dequantized) weights in the
    same dtype within its rounding, as in test_model_vs_transformers, and the widened route's are
    the emulated route's (``widen=False``) within one rounding of the two sums."""
    model, _ = load_model(folder, dtype=dtype)
    if mode:
        quantize(model, mode, 32 if mode == "int4" else None)
    reference_folder = write_dequantized(folder, model, tmp_path / "dequantized") if mode else folder
    reference = transformers.BloomForCausalLM.from_pretrained(reference_folder, torch_dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (40, 23)]
    ids = torch.full((2, 40), 3, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    logits = {}
    for widen in (True, False):
        plan = accelerate(model, CpuOptions(path=path, widen=widen))
        assert ("weights widened" in plan.description) == widen
        cache = model.allocate_cache(2, 48)
        with torch.no_grad():
            logits[widen] = model.prefill(ids, lengths, cache).float()
    ours = logits[True]
    scale = ours.abs().max()
    assert (ours - logits[False]).abs().max() < 0.03 * scale
    with torch.no_grad():
        for b, row in enumerate(rows):
            ref = reference(torch.tensor([row])).logits[0, -1].float()
            assert (ours[b] - ref).abs().max() < 0.05 * scale
            assert ref[ours[b].argmax()] >= ref.max() - 0.05 * scale
