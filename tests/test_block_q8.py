"""The integer products of our CPU kernels (``csrc/block_q8.h``) against their definition in public
ops (``bloom_hpu/int8_activations.py``), for each build this CPU runs: the rounding of the input bit
for bit, the products within fp32's rounding of the sums (in bf16 and fp16, within one rounding of
the dtype), int8 and int4 weights, any number of rows, a row of zeros and a block with one huge
value, with and without bias; bad input is refused with a message. On a CPU with AMX-INT8, the int8
products of more than 4 rows on its tiles (``csrc/block_q8_amx.h``) are the panel kernel's bit for bit.
The threaded GELU (``gelu_tanh``) is F.gelu's within one rounding."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bloom_hpu.int4 import group_scales, quantize_groups
from bloom_hpu.int8_activations import block_product, quantize_blocks
from bloom_hpu.runtime.cpu.kernels import load

from bloom_hpu.runtime.cpu import capability
from bloom_hpu.runtime.cpu.layers import AMX_MIN_ROWS

from isas import ALL_KERNEL_ISAS, needs_amx_tiles, needs_isa

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WEIGHTS = ["int8", "int4 G=32", "int4 G=64", "int4 G=128", "int4 G=256"]
K = 256


def kernels_for(isa: str):
    needs_isa(isa)
    return load(isa)


def inputs(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """rows x K values, row 0 all zeros, and (from 2 rows) a block of row 1 with one value 1000x the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g) * 3
    x[0] = 0
    if rows > 1:
        x[1, 70] = 3000.0
    return x.to(dtype)


def weight(kind: str, n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "int8":
        return torch.randint(-127, 128, (n, K), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 64 + 1e-3
    w = torch.randn(n, K, generator=g)
    scales = group_scales(w, int(kind.split("=")[1]))
    return quantize_groups(w, scales), scales


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_is_the_reference_bit_for_bit(isa, dtype):
    kernels = kernels_for(isa)
    for rows in (1, 3, 17, 128):
        x = inputs(rows, dtype, seed=rows)
        got, want = kernels.block_q8_quantize(x), quantize_blocks(x)
        assert got[0].dtype == torch.int8 and got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x = inputs(6, dtype).view(2, 3, K)  # leading dimensions kept
    got, want = kernels.block_q8_quantize(x), quantize_blocks(x)
    assert got[0].shape == (2, 3, K) and got[1].shape == (2, 3, K // 32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", WEIGHTS)
def test_linear_agrees_with_the_reference(isa, dtype, kind):
    kernels = kernels_for(isa)
    # fp32: the sums' order differs from F.linear's; bf16/fp16: then one rounding to the dtype.
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    for n in (20, 100):
        q, scales = weight(kind, n, seed=n)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        # 7, 10 and 17: a tile of 4 rows and the last 3, 2 or 1 in a smaller tile (on AVX-512, 7
        # rows: two passes of the few-rows path, 4 rows and the last 3; 8 rows the panel's first)
        for rows in (1, 3, 7, 8, 10, 17, 128):
            x = inputs(rows, dtype, seed=rows)
            for b in (None, bias):
                got = kernels.block_q8_linear(x, q, scales, b)
                assert got.dtype == dtype and got.shape == (rows, n)
                exact = block_product(x.float(), q, scales, None if b is None else b.float())
                size = exact.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
                error = (got.float() - exact).abs()
                assert (error <= 1e-5 * size + ulp * exact.abs()).all(), (kind, n, rows, b is None, error.max())
                assert torch.equal(got[0], torch.zeros(n, dtype=dtype) if b is None else b)  # the zero row


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_the_rows_taken_in_place_are_set_per_format(isa):
    """``set_q8_few_rows``: up to that many rows the weight is read in place, where every row's
    sums run as they do alone; past it the panel sums in another order (both within the reference's
    tolerance). Per weight format; from one pass (4 rows) to what the build's path takes (8 on
    AVX-512, 4 on AVX2), anything else refused."""
    kernels = kernels_for(isa)
    one_pass, default, most = kernels.q8_few_rows_bounds()
    assert (one_pass, most) == ((4, 8) if isa == "avx512_bf16" else (4, 4)) and one_pass <= default <= most
    x = inputs(most, torch.float32, seed=3)
    # The build's default comes back after the test (conftest.integer_rows_by_default).
    for kind, fmt in (("int8", 1), ("int4 G=64", 2)):
        q, scales = weight(kind, 100, seed=4)
        alone = torch.cat([kernels.block_q8_linear(x[i:i + 1], q, scales, None) for i in range(most)])
        assert kernels.set_q8_few_rows(most, fmt) == most
        assert torch.equal(kernels.block_q8_linear(x, q, scales, None), alone)  # in place: each row alone
        if most > one_pass:
            assert kernels.set_q8_few_rows(most - 1, fmt) == most - 1
            panel = kernels.block_q8_linear(x, q, scales, None)
            assert not torch.equal(panel, alone)  # the panel's order: other bits
            exact = block_product(x, q, scales, None)
            torch.testing.assert_close(panel, exact, rtol=1e-5, atol=1e-5 * exact.abs().amax().item())
            other = 2 if fmt == 1 else 1  # the other format keeps its own count
            assert kernels.set_q8_few_rows(most, other) == most
            assert not torch.equal(kernels.block_q8_linear(x, q, scales, None), alone)
    for rows, fmt in ((one_pass - 1, 1), (most + 1, 2), (one_pass, 0), (one_pass, 3)):
        with pytest.raises(RuntimeError, match="set_q8_few_rows"):
            kernels.set_q8_few_rows(rows, fmt)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_linear_keeps_leading_dimensions_and_matches_in_dtype(isa):
    kernels = kernels_for(isa)
    q, scales = weight("int4 G=64", 48)
    x = inputs(6, torch.float32).view(2, 3, K)
    got, exact = kernels.block_q8_linear(x, q, scales, None), block_product(x, q, scales, None)
    assert got.shape == (2, 3, 48)
    # As in test_linear_agrees_with_the_reference: the sums' order differs from the reference's, so
    # an output near zero in a row of large ones is held to the row's scale.
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * exact.abs().amax().item())


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_an_odd_number_of_blocks(isa):
    """K = 96: three blocks a row (the AVX-512 build's few-rows path takes them two at a time); and
    39 outputs, so that the few-rows path's last 3 weight rows go one by one (on AVX2, int4, each
    paired with itself)."""
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(39, 96, generator=g)
    int8 = (torch.randint(-127, 128, (39, 96), generator=g, dtype=torch.int8), torch.rand(39, generator=g))
    int4 = (quantize_groups(w, group_scales(w, 32)), group_scales(w, 32))
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=g)
        for q, scales in (int8, int4):
            torch.testing.assert_close(kernels.block_q8_linear(x, q, scales, None), block_product(x, q, scales, None),
                                       rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_weight_rows_of_zeros(isa):
    """A vocabulary padded with zero rows: their scales are the smallest normal float, and their
    products with the input's scales denormal (which the kernel flushes while it multiplies). The
    result is the reference's, zeros in those columns, and rounding x leaves the caller's thread
    as it was (a denormal input still rounds as the reference rounds it)."""
    kernels = kernels_for(isa)
    from bloom_hpu.quantize import quantize_weight

    w = torch.randn(40, K)
    w[8:24] = 0
    for group_size in (None, 64):
        q, scales = quantize_weight(w, group_size)
        for rows in (1, 3, 17):
            x = torch.randn(rows, K) * 3
            got = kernels.block_q8_linear(x, q, scales, None)
            torch.testing.assert_close(got, block_product(x, q, scales, None), rtol=1e-5, atol=1e-4)
            assert not got[:, 8:24].any()
    tiny = torch.full((1, K), 1e-39)
    assert [torch.equal(a, b) for a, b in zip(kernels.block_q8_quantize(tiny), quantize_blocks(tiny))] == [True, True]


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_bad_input_is_refused_with_a_message(isa):
    kernels = kernels_for(isa)
    q8, s8 = weight("int8", 20)
    q4, s4 = weight("int4 G=64", 20)
    x = inputs(3, torch.float32)
    cases = [
        (lambda: kernels.block_q8_linear(x.double(), q8, s8, None), "bf16, fp16 or fp32"),
        (lambda: kernels.block_q8_linear(x[:, :128], q8, s8, None), r"x \[\.\.\., K\]"),
        (lambda: kernels.block_q8_linear(x[:, :48], q8[:, :48].contiguous(), s8, None), "multiple of 32"),
        (lambda: kernels.block_q8_linear(x, q8.short(), s8, None), "int8 weight"),
        (lambda: kernels.block_q8_linear(x, q8, s8[:10], None), "scales"),
        (lambda: kernels.block_q8_linear(x, q8, s8.double(), None), "scales"),
        (lambda: kernels.block_q8_linear(x, q4, s4[:, :3], None), "groups"),
        (lambda: kernels.block_q8_linear(x, q8, s8, torch.zeros(20, dtype=torch.bfloat16)), "bias"),
        (lambda: kernels.block_q8_linear(x, q8, s8, torch.zeros(21)), "bias"),
        (lambda: kernels.block_q8_quantize(x[:, :48].contiguous()), "multiple of 32"),
        (lambda: kernels.block_q8_quantize(x.int()), "bf16, fp16 or fp32"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
def test_fake_shapes(isa):
    kernels = kernels_for(isa)
    q4, s4 = weight("int4 G=32", 20)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(inputs(3, torch.bfloat16).view(1, 3, K))
        out = kernels.block_q8_linear(x, mode.from_tensor(q4), mode.from_tensor(s4), None)
        xq, d = kernels.block_q8_quantize(x)
    assert out.shape == (1, 3, 20) and out.dtype == torch.bfloat16
    assert xq.shape == (1, 3, K) and xq.dtype == torch.int8 and d.shape == (1, 3, K // 32) and d.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 160, 256])
def test_int8_products_on_amx_int8_tiles_are_the_panel_kernels_bit_for_bit(dtype, k):
    """K = 64, 160, 256: 2, 5 and 8 blocks, so the tiles' pipelined loop (4 blocks a turn) runs not at
    all, once with a block left over, and twice. Rows past 16 and 32 take more input tiles; 9 rows
    is a count the panel kernel serves with the tiles off (the tiles serve 5 and more; without
    them 5-7 rows take the few-rows path's two passes, summed in another order). 40 outputs are
    not whole tiles: the panel kernel serves them."""
    kernels = needs_amx_tiles()
    if "amx_int8" not in (capability.cpu_flags() or set()):
        pytest.skip("no AMX-INT8 here")
    g = torch.Generator().manual_seed(k)
    try:
        for n in (16, 48, 40):
            q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scales = torch.rand(n, generator=g) / 64 + 1e-3
            bias = torch.randn(n, generator=g).to(dtype)
            for rows in (9, 16, 37):
                x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
                for b in (None, bias):
                    kernels.enable_amx(AMX_MIN_ROWS)
                    tiles = kernels.block_q8_linear(x, q, scales, b)
                    kernels.enable_amx(0)
                    panel = kernels.block_q8_linear(x, q, scales, b)
                    assert torch.equal(tiles, panel), (n, rows, b is None, (tiles.float() - panel.float()).abs().max())
    finally:
        kernels.enable_amx(AMX_MIN_ROWS)


@pytest.mark.parametrize("isa", ALL_KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_threaded_gelu_is_torchs_within_a_rounding(isa, dtype):
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5000, generator=g) * 4).to(dtype)  # not a whole number of tasks or vectors
    x[0, :3] = torch.tensor([0.0, -30.0, 30.0])
    got = kernels.gelu_tanh(x)
    want = torch.nn.functional.gelu(x.float(), approximate="tanh")
    step = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    assert got.dtype == dtype and got.shape == x.shape
    assert ((got.float() - want).abs() <= step * want.abs() + 1e-6).all()
    assert got[0, 0] == 0 and got[0, 1] == 0 and got[0, 2] == 30
    assert kernels.gelu_tanh(x[:, ::2]).shape == (3, 2500)  # a strided input is made contiguous
