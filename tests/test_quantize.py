"""Weight-only int8 and int4 (bloom_hpu/quantize.py, bloom_hpu/int4.py) against transformers running
our dequantized weights.

The arithmetic contract, for each mode: our quantized model gives the greedy and beam tokens, and
the log-probs (to 1e-4), of transformers' BloomForCausalLM whose weights were replaced once by
``q * scale`` (fp32), on a peaky random checkpoint; seeded samples equal those of our unquantized
model on the same dequantized weights; two ranks give one process's tokens. Then the quantization
itself: weights within half a step of the originals, about half (int8) or a quarter and a bit
(int4) of the bytes of bf16, and the embedded default's held-out perplexity within 1% (int8) or
5% (int4) of fp32's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
import torch
import torch.nn.functional as F
import transformers

from bloom_hpu.int4 import dequantized_int4
from bloom_hpu.loading import load_model
from bloom_hpu.quantize import QuantizeError, quantize, weight_bytes
from dequantized import dequantized_weight, held_out_perplexities, write_dequantized
from generation.generator import Generator

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello, world", "Numbers 1 2 3 4"]


def two_rank_tokens(tmp_path, *weights) -> list[list[int]]:
    """``./bloom.py WEIGHTS --max_length 20`` on PROMPTS[1:] under the deepspeed launcher, 2 ranks:
    each prompt's generated ids."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               str(ROOT / "bloom.py"), *weights, "--max_length", "20", "--quiet", "--output_file", str(out),
               *PROMPTS[1:]]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [r["token_ids"] for r in json.loads(out.read_text())]


@pytest.fixture(scope="module")
def folder(seed7_checkpoint):
    return seed7_checkpoint


MODES = ["int8", "int4"]
# int4's group size in these tests: the default 64 is a whole row of the test model's narrow layers;
# 32 gives two groups there, and divides each of 2 ranks' halves of a row.
GROUP = 32


def quantize_args(mode: str) -> dict:
    return dict(quantize=mode, group_size=GROUP if mode == "int4" else None)


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def quantized(folder, mode):
    return Generator.from_pretrained(folder, **quantize_args(mode))


@pytest.fixture(scope="module")
def dequantized_folder(folder, quantized, tmp_path_factory):
    """The checkpoint with every quantized weight replaced by its dequantized value."""
    return write_dequantized(folder, quantized.model, tmp_path_factory.mktemp("dequantized"))


@pytest.fixture(scope="module")
def reference(dequantized_folder):
    return transformers.BloomForCausalLM.from_pretrained(dequantized_folder).eval()


def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=3)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_greedy_tokens_and_logprobs_are_transformers_on_the_dequantized_weights(quantized, reference):
    for prompt in PROMPTS:
        ids = quantized.tokenizer.encode(prompt)
        result = quantized.generate(prompt, max_length=len(ids) + 12, ignore_eos=True, logprobs=True)[0]
        tokens, logprobs = hf_greedy(reference, ids, 12)
        assert result.token_ids == tokens
        assert result.sequences[0].token_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_beams_are_transformers_on_the_dequantized_weights(quantized, reference):
    ids = quantized.tokenizer.encode(PROMPTS[0])
    ours = quantized.generate(PROMPTS[0], max_length=len(ids) + 8, num_beams=3, num_return_sequences=2, ignore_eos=True)
    theirs = reference.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=3, num_return_sequences=2,
                                do_sample=False, pad_token_id=3)
    assert [s.token_ids for s in ours[0].sequences] == [row[len(ids):].tolist() for row in theirs]


def test_seeded_samples_are_those_of_the_dequantized_weights(quantized, dequantized_folder):
    plain = Generator.from_pretrained(dequantized_folder)
    options = dict(max_length=24, do_sample=True, seed=3, top_k=20, num_return_sequences=2)
    assert [[s.token_ids for s in r.sequences] for r in quantized.generate(PROMPTS, **options)] == \
        [[s.token_ids for s in r.sequences] for r in plain.generate(PROMPTS, **options)]


@pytest.mark.parametrize("mode, share", [("int8", 0.6), ("int4", 0.4)])
def test_weights_are_within_half_a_step_and_take_fewer_bytes(folder, mode, share):
    model, _ = load_model(folder, torch.bfloat16)
    originals = {name: m.weight.detach().float().clone() for name, m in model.named_modules()
                 if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2}
    bf16 = weight_bytes(model)
    quantize(model, mode, GROUP if mode == "int4" else None)
    for name, module in model.named_modules():
        if getattr(module, "qweight", None) is not None:
            error = (dequantized_weight(module) - originals[name]).abs()
            steps = module.scales[:, None] if mode == "int8" else module.scales.repeat_interleave(GROUP, dim=1)
            assert (error <= steps / 2 + 1e-6).all(), name
    # Norms and biases stay in bf16; a tiny model's share of them is larger than bloom-560m's.
    assert weight_bytes(model) <= share * bf16
    with pytest.raises(QuantizeError, match="quantized already"):
        quantize(model)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_cpu_path_runs_a_quantized_model(folder, dtype, mode):
    """The CPU's own kernels and one-call quantized decode step (auto), PyTorch's operations op by op
    (plain: torch._weight_int8pack_mm, int4 dequantized in the product): in fp32 the same tokens; in
    bf16 each rounds its own way, so both only run."""
    from bloom_hpu.runtime.cpu import CpuOptions
    from bloom_hpu.runtime.cpu.capability import detect

    results = {}
    for path in ("auto", "plain"):
        generator = Generator.from_pretrained(folder, dtype=dtype, cpu=CpuOptions(path=path), **quantize_args(mode))
        if path == "auto" and detect().kernel_isa is not None:
            assert f"{mode} few-rows products" in generator.backend.fast_path
            assert f"one-call decode step ({mode})" in generator.backend.fast_path
        results[path] = [r.token_ids for r in generator.generate(PROMPTS, max_length=32)]
    if dtype == "fp32":
        assert results["auto"] == results["plain"]


@pytest.mark.parametrize("mode, group_size, within", [("int8", None, 0.01), ("int4", None, 0.05)])
def test_held_out_perplexity_of_the_default_stays_close_to_fp32(tiny_checkpoint, mode, group_size, within):
    """The embedded KJV model quantized (int4 at its default group size) against fp32, on its held-out
    chapters (when the corpus can be fetched), else on its own README's text."""
    ours = Generator.from_pretrained(tiny_checkpoint, quantize=mode, group_size=group_size)
    base, got = held_out_perplexities(tiny_checkpoint, ours.model)
    print(f"held-out perplexity: fp32 {base:.3f}, {mode} {got:.3f} ({got / base - 1:+.2%})")
    assert abs(got / base - 1) <= within


def test_bad_quantization_flags_are_one_line(folder, capsys):
    import bloom

    assert bloom.main(["--weights", str(folder), "--quantize", "int8", "--mode", "vanilla", "Hi"]) == 1
    assert "--quantize" in capsys.readouterr().err
    assert bloom.main(["--weights", str(folder), "--quantize", "int8", "--group_size", "32", "Hi"]) == 1
    assert "--group_size goes with --quantize int4" in capsys.readouterr().err
    for group, says in (("48", "not one of 32, 64, 128, 256"), ("128", "does not divide the rows")):
        assert bloom.main(["--weights", str(folder), "--quantize", "int4", "--group_size", group, "Hi"]) == 1
        err = capsys.readouterr().err
        assert says in err and err.count("\n") <= 2 and "Traceback" not in err, err
    with pytest.raises(QuantizeError, match="unknown quantization"):
        Generator.from_pretrained(folder, quantize="int3")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_two_ranks_quantized_give_one_process_tokens(folder, tmp_path, mode):
    """int8: row-parallel layers take the whole row's scale (an all-reduce of the row maxima); int4:
    groups lie within a rank's half of a row. Either way the same weights on 2 ranks as in one process."""
    flags = ["--quantize", mode] + (["--group_size", str(GROUP)] if mode == "int4" else [])
    got = two_rank_tokens(tmp_path, "--weights", str(folder), *flags)
    one = Generator.from_pretrained(folder, **quantize_args(mode))
    want = [r.token_ids for r in one.generate(PROMPTS[1:], max_length=20)]
    assert got == want


@pytest.mark.slow
def test_an_int4_group_that_crosses_a_rank_boundary_is_one_line(folder, tmp_path):
    """The test model's dense layer has rows of 64: 2 ranks hold 32 each, which groups of 64 would cross."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               str(ROOT / "bloom.py"), "--weights", str(folder), "--quantize", "int4", "--group_size", "64", "Hi"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode != 0
    assert "does not divide the rows" in done.stderr and "each of 2 ranks holds a part of a row" in done.stderr
    assert "Traceback" not in done.stderr


# --- a checkpoint saved quantized (utils/quantize_checkpoint.py) -------------------------------------


@pytest.fixture(scope="module")
def saved_folder(folder, mode, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / mode
    flags = ["--quantize", mode] + (["--group_size", str(GROUP)] if mode == "int4" else [])
    done = subprocess.run([sys.executable, str(ROOT / "utils" / "quantize_checkpoint.py"), "--weights", str(folder),
                           "--out", str(out), *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def test_a_saved_checkpoint_loads_quantized_and_gives_the_same_tokens(quantized, saved_folder, mode):
    config = json.loads((saved_folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bloom_hpu"
    assert config["quantization_config"]["bits"] == (8 if mode == "int8" else 4)
    index = json.loads((saved_folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "h.0.mlp.dense_h_to_4h.qweight" in index and "h.0.mlp.dense_h_to_4h.weight" not in index
    loaded = Generator.from_pretrained(saved_folder)  # quantized without being asked: the checkpoint is
    assert weight_bytes(loaded.model) == weight_bytes(quantized.model)
    options = dict(max_length=24, ignore_eos=True)
    want = [r.token_ids for r in quantized.generate(PROMPTS, **options)]
    assert [r.token_ids for r in loaded.generate(PROMPTS, **options)] == want
    again = Generator.from_pretrained(saved_folder, **quantize_args(mode))  # asking for what it is: the same
    assert [r.token_ids for r in again.generate(PROMPTS, **options)] == want
    other = "int4" if mode == "int8" else "int8"
    with pytest.raises(QuantizeError, match=f"stored {mode}"):
        Generator.from_pretrained(saved_folder, **quantize_args(other))


@pytest.mark.slow
def test_two_ranks_read_their_slices_of_a_saved_checkpoint(saved_folder, quantized, tmp_path):
    want = [r.token_ids for r in quantized.generate(PROMPTS[1:], max_length=20)]
    assert two_rank_tokens(tmp_path, "--weights", str(saved_folder)) == want


def test_checkpoints_quantized_otherwise_or_twice_are_one_line(folder, saved_folder, tmp_path):
    other = tmp_path / "bnb"
    other.mkdir()
    for item in folder.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (other / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, str(ROOT / "bloom.py"), "--weights", str(other), "Hi"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "quantized as 'bitsandbytes'" in done.stderr and "Traceback" not in done.stderr
    again = subprocess.run([sys.executable, str(ROOT / "utils" / "quantize_checkpoint.py"), "--weights",
                            str(saved_folder), "--out", str(tmp_path / "twice")], capture_output=True, text=True)
    assert again.returncode == 1 and "quantized already" in again.stderr


# --- the CPU's quantized kernels, on every build this CPU runs ---------------------------------------

from isas import KERNEL_ISAS  # noqa: E402


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_int8_kernel_is_the_dequantized_product(isa, dtype):
    from bloom_hpu.runtime.cpu.kernels import load

    kernel = load(isa).int8_rows_linear
    g = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 1030, 1024), (3, 7, 64), (5, 64, 4096), (2, 9, 48), (12, 33, 96), (64, 20, 128)):
        x = torch.randn(m, k, generator=g).to(dtype)
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, generator=g) / 100
        bias = torch.randn(n, generator=g).to(dtype)
        want = torch.nn.functional.linear(x.float(), q.float() * scales[:, None], bias.float())
        got = kernel(x, q, scales, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
        torch.testing.assert_close(got.float(), want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_products_of_float_rows_never_take_the_int8pack_op(monkeypatch, dtype):
    """torch._weight_int8pack_mm is for bf16 rows: with fp32 or fp16 ones it takes milliseconds per
    row (a 16-token fp32 prompt ran 8 s), so the public-op product dequantizes instead, with the
    same sum."""
    from bloom_hpu.quantize import int8_product

    def refuse(*args):
        raise AssertionError("torch._weight_int8pack_mm called with " + str(args[0].dtype))

    monkeypatch.setattr(torch, "_weight_int8pack_mm", refuse)
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    scales = torch.rand(48, generator=g) / 100
    x = torch.randn(5, 64, generator=g).to(dtype)
    want = F.linear(x.float(), q.float() * scales[:, None])
    torch.testing.assert_close(int8_product(x, q, scales).float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_int4_kernel_is_the_dequantized_product(isa, dtype):
    """int4_rows_linear against F.linear over the weight dequantized by public ops, for group sizes
    of one block to a whole row, 1 to 64 rows; and int4_dequantize, bit for bit."""
    from bloom_hpu.int4 import group_scales, quantize_groups
    from bloom_hpu.runtime.cpu.kernels import load

    kernels = load(isa)
    g = torch.Generator().manual_seed(2)
    for m, n, k, group in ((1, 1030, 1024, 64), (3, 7, 64, 32), (5, 64, 4096, 128), (12, 33, 96, 32),
                           (64, 20, 256, 256), (9, 24, 512, 64)):
        packed_scales = group_scales(torch.randn(n, k, generator=g), group)
        packed = quantize_groups(torch.randn(n, k, generator=g) * packed_scales.repeat_interleave(group, 1) * 7,
                                 packed_scales)
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        weight = dequantized_int4(packed, packed_scales)
        want = torch.nn.functional.linear(x.float(), weight, bias.float())
        got = kernels.int4_rows_linear(x, packed, packed_scales, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        # fp32: sums in another order (and nibble values offset by 8 and corrected per group), so
        # differences of a few fp32 steps of the largest output
        scale = want.abs().max().item()
        tolerance = dict(rtol=1e-5, atol=4e-6 * scale) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-3 * scale)
        torch.testing.assert_close(got.float(), want, **tolerance)
        out = torch.empty(n, k, dtype=dtype)
        kernels.int4_dequantize(packed, packed_scales, out)
        assert torch.equal(out, dequantized_int4(packed, packed_scales, dtype))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_products_of_many_rows_on_amx_tiles_are_the_exact_product_rounded_once(kind):
    """With the AMX tiles on (a CPU with AMX only), bf16 products over int8 and int4 weights of 8 rows
    or more run on them, the weight widened (int8) or dequantized (int4, as int4_dequantize does it) a
    strip of 32 rows at a time: the exact product over those weights, rounded once, to the bounds of
    the bf16 tiles' test. 48 outputs: a strip and a half; rows past 16 and 32 take more input tiles."""
    from bloom_hpu.int4 import group_scales, quantize_groups
    from bloom_hpu.runtime.cpu.layers import AMX_MIN_ROWS

    from isas import needs_amx_tiles

    kernels = needs_amx_tiles()
    g = torch.Generator().manual_seed(5)
    for rows, n, k in ((8, 48, 256), (16, 32, 1024), (37, 48, 96), (130, 16, 512)):
        x = torch.randn(rows, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        if kind == "int8":
            q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scales = torch.rand(n, generator=g) / 100
            weight64 = q.double() * scales.double()[:, None]
            product = kernels.int8_rows_linear
        else:
            w = torch.randn(n, k, generator=g)
            scales = group_scales(w, 32)
            q = quantize_groups(w, scales)
            weight64 = dequantized_int4(q, scales, torch.bfloat16).double()
            product = kernels.int4_rows_linear
        exact = F.linear(x.double(), weight64, bias.double())
        terms = F.linear(x.double().abs(), weight64.abs(), bias.double().abs())
        bound = 2.0 ** -8 * exact.abs() + k * 2.0 ** -24 * terms + 1e-30
        try:
            tiles = product(x, q, scales, bias)
            kernels.enable_amx(0)
            loop = product(x, q, scales, bias)
        finally:
            kernels.enable_amx(AMX_MIN_ROWS)
        assert tiles.dtype == torch.bfloat16 and tiles.shape == (rows, n)
        assert ((tiles.double() - exact).abs() <= bound).all(), (rows, n, k)
        assert ((tiles.double() - loop.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype, rows", [("fp32", 2), ("bf16", 8)])
def test_the_one_call_quantized_step_is_the_quantized_model_op_by_op(folder, isa, dtype, rows, mode):
    """decode_step_quantized against the same quantized model's decode op by op: in fp32 (2 rows) the
    same logits; in bf16, 8 rows in one call (the products take the kernels' many-row paths, which
    the tests above check against F.linear) the same within bf16's rounding of the two orders of ops."""
    generator, plan, model, cache, g, lengths = quantized_one_call(folder, isa, dtype, mode, rows)
    assert plan.decode_rows >= rows
    with torch.no_grad():
        tokens, positions = torch.randint(4, 200, (rows, 1), generator=g), lengths.clone()
        one_call = plan.decode(tokens, positions, cache, 16).float()
        with plan.op_by_op():
            op_by_op = model.decode(tokens, positions, cache, 16).float()
    assert_same_logits(one_call, op_by_op, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype, rows", [("fp32", 2), ("bf16", 8)])
def test_the_one_call_quantized_mixed_step_is_the_quantized_model_op_by_op(folder, isa, dtype, rows, mode):
    """The server's mixed step over quantized weights as one call (``OneCallDecode.mixed``) against
    the same model's ``mixed`` op by op: the rows and two pieces of a prompt joining the last row
    (the second padded), so the quantized products take more rows than the rows' decode alone."""
    generator, plan, model, cache, g, lengths = quantized_one_call(folder, isa, dtype, mode, rows)
    reference = model.allocate_cache(rows, 32)
    reference.keys.copy_(cache.keys)
    reference.values.copy_(cache.values)
    with torch.no_grad():
        tokens, positions = torch.randint(4, 200, (rows, 1), generator=g), lengths.clone()
        positions[-1] = 4  # the joining row's filler, at the slot its first piece then writes
        chunk = torch.randint(4, 200, (2, 8), generator=g)
        pieces = (torch.tensor([rows - 1] * 2), torch.tensor([4, 12]), torch.tensor([8, 5]))
        one_call = plan.decode.mixed(tokens, positions, chunk, *pieces, cache, 32).float()
        with plan.op_by_op():
            op_by_op = model.mixed(tokens, positions, chunk, *pieces, reference, 32).float()
    assert one_call.shape == (rows + 2, model.config.vocab_size)
    returned = [i for i in range(rows + 2) if i != rows - 1]  # the filler's logits: zeros in the one call
    assert not one_call[rows - 1].any()
    assert_same_logits(one_call[returned], op_by_op[returned], dtype)


def quantized_one_call(folder, isa: str, dtype: str, mode: str, rows: int):
    """A quantized generator on ``isa``'s one-call steps, and a cache of ``rows`` rows holding short
    prompts (their lengths, and the random stream that drew them, are returned for the step's inputs)."""
    from bloom_hpu.runtime.cpu import CpuOptions

    generator = Generator.from_pretrained(folder, dtype=dtype, cpu=CpuOptions(path=isa), **quantize_args(mode))
    plan = generator.backend.cpu_plan
    assert plan.decode is not None and plan.decode.scales is not None
    model = generator.model
    cache = model.allocate_cache(rows, 32)
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(4, 200, (rows, 4), generator=g)
    lengths = torch.randint(1, 5, (rows,), generator=g)
    with torch.no_grad():
        model.prefill(ids, lengths, cache)
    return generator, plan, model, cache, g, lengths


def assert_same_logits(one_call: torch.Tensor, op_by_op: torch.Tensor, dtype: str) -> None:
    """In fp32 the same logits; in bf16 the same within bf16's rounding of the two orders of ops."""
    if dtype == "fp32":
        torch.testing.assert_close(one_call, op_by_op, rtol=1e-4, atol=1e-4)
    else:
        scale = op_by_op.abs().max().item()
        torch.testing.assert_close(one_call, op_by_op, rtol=0, atol=0.03 * scale)
        assert (one_call.argmax(-1) == op_by_op.argmax(-1)).float().mean() >= 0.75


# --- the other entry points: a request-file job and the chat shell ---------------------------------


def hf_text(model, tokenizer, prompt: str, new: int) -> str:
    """transformers' greedy continuation's text, cut at EOS."""
    ids = tokenizer.encode(prompt)
    tokens = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=3)[0, len(ids):]
    tokens = tokens.tolist()
    return tokenizer.decode(tokens[:tokens.index(2)] if 2 in tokens else tokens)


def test_a_request_file_job_and_the_chat_shell_run_quantized(folder, mode, quantized, reference, dequantized_folder,
                                                             tmp_path):
    """``--requests`` and ``--chat`` with ``--quantize``: greedy text equal to transformers' on the
    dequantized weights."""
    import bloom
    from test_chat import ask, reference_reply, spawn, STARTUP

    flags = ["--quantize", mode] + (["--group_size", str(GROUP)] if mode == "int4" else [])
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": 10, "temperature": 0}) + "\n" for p in PROMPTS))
    assert bloom.main(["--weights", str(folder), *flags, "--requests", str(requests), "--results", str(results)]) == 0
    lines = [json.loads(line) for line in results.read_text().splitlines()]  # in the order they finished
    texts = {line["request"]["prompt"]: line["result"]["choices"][0]["text"] for line in lines}
    assert texts == {p: hf_text(reference, quantized.tokenizer, p, 10) for p in PROMPTS}

    shell = spawn("--chat", "--weights", str(folder), *flags, "--sample", "f", "--max-tokens", "12",
                  "--max_length", "256", "--ignore_eos", "t")
    shell.expect_exact(">>> ", timeout=STARTUP)
    reply = ask(shell, "Hello, who are you?")
    assert reply == reference_reply(dequantized_folder, "<human>: Hello, who are you?\n<bot>:", 12, eos=False) + "\n"
    shell.sendeof()
    shell.expect(pexpect.EOF)
    assert shell.wait() == 0
