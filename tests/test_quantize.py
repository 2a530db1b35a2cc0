"""Weight-only int8 (bloom_hpu/quantize.py) against transformers running our dequantized weights.

The arithmetic contract: our int8 model gives the greedy and beam tokens, and the log-probs (to
1e-4), of transformers' BloomForCausalLM whose weights were replaced once by ``q * scale`` (fp32),
on a peaky random checkpoint; seeded samples equal those of our unquantized model on the same
dequantized weights; two ranks give one process's tokens. Then the quantization itself: weights
within half a step of the originals, about half the bytes of bf16, and the embedded default's
held-out perplexity within 1% of fp32's.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bloom_hpu.loading import load_model
from bloom_hpu.quantize import QuantizeError, dequantized, quantize, weight_bytes
from generation.generator import Generator
from utils.random_checkpoint import make_random_checkpoint

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
def folder(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("int8"), hidden_size=64, n_layer=3, n_head=4, seed=7)


@pytest.fixture(scope="module")
def int8(folder):
    return Generator.from_pretrained(folder, quantize="int8")


def dequantized_state(model) -> dict[str, torch.Tensor]:
    """Our quantized model's weights as transformers names them, each ``q * scale`` in fp32."""
    state = {}
    for name, module in model.named_modules():
        if getattr(module, "qweight", None) is not None:
            state[f"{name}.weight"] = dequantized(module.qweight, module.scales)
    return state


@pytest.fixture(scope="module")
def dequantized_folder(folder, int8, tmp_path_factory):
    """The checkpoint with every quantized weight replaced by its dequantized value."""
    out = tmp_path_factory.mktemp("dequantized")
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    weights = load_file(folder / "model.safetensors")
    replaced = dequantized_state(int8.model)
    assert set(replaced) <= set(weights) and "word_embeddings.weight" in replaced
    weights.update(replaced)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def reference(dequantized_folder):
    return transformers.BloomForCausalLM.from_pretrained(dequantized_folder).eval()


def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=3)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_greedy_tokens_and_logprobs_are_transformers_on_the_dequantized_weights(int8, reference):
    for prompt in PROMPTS:
        ids = int8.tokenizer.encode(prompt)
        result = int8.generate(prompt, max_length=len(ids) + 12, ignore_eos=True, logprobs=True)[0]
        tokens, logprobs = hf_greedy(reference, ids, 12)
        assert result.token_ids == tokens
        assert result.sequences[0].token_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_beams_are_transformers_on_the_dequantized_weights(int8, reference):
    ids = int8.tokenizer.encode(PROMPTS[0])
    ours = int8.generate(PROMPTS[0], max_length=len(ids) + 8, num_beams=3, num_return_sequences=2, ignore_eos=True)
    theirs = reference.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=3, num_return_sequences=2,
                                do_sample=False, pad_token_id=3)
    assert [s.token_ids for s in ours[0].sequences] == [row[len(ids):].tolist() for row in theirs]


def test_seeded_samples_are_those_of_the_dequantized_weights(int8, dequantized_folder):
    plain = Generator.from_pretrained(dequantized_folder)
    options = dict(max_length=24, do_sample=True, seed=3, top_k=20, num_return_sequences=2)
    assert [[s.token_ids for s in r.sequences] for r in int8.generate(PROMPTS, **options)] == \
        [[s.token_ids for s in r.sequences] for r in plain.generate(PROMPTS, **options)]


def test_weights_are_within_half_a_step_and_take_half_the_bytes(folder):
    model, _ = load_model(folder, torch.bfloat16)
    originals = {name: m.weight.detach().float().clone() for name, m in model.named_modules()
                 if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2}
    bf16 = weight_bytes(model)
    quantize(model)
    for name, module in model.named_modules():
        if getattr(module, "qweight", None) is not None:
            error = (dequantized(module.qweight, module.scales) - originals[name]).abs()
            assert (error <= module.scales[:, None] / 2 + 1e-6).all(), name
    # Norms and biases stay in bf16; a tiny model's share of them is larger than bloom-560m's.
    assert weight_bytes(model) <= 0.6 * bf16
    with pytest.raises(QuantizeError, match="quantized already"):
        quantize(model)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_cpu_path_runs_a_quantized_model(folder, dtype):
    """The CPU's own int8 kernel and one-call int8 decode step (auto), torch._weight_int8pack_mm op by
    op (plain): in fp32 the same tokens; in bf16 each rounds its own way, so both only run."""
    from bloom_hpu.runtime.cpu import CpuOptions
    from bloom_hpu.runtime.cpu.capability import detect

    results = {}
    for path in ("auto", "plain"):
        generator = Generator.from_pretrained(folder, dtype=dtype, quantize="int8", cpu=CpuOptions(path=path))
        if path == "auto" and detect().kernel_isa is not None:
            assert "int8 few-rows products" in generator.backend.fast_path
            assert "one-call decode step (int8)" in generator.backend.fast_path
        results[path] = [r.token_ids for r in generator.generate(PROMPTS, max_length=32)]
    if dtype == "fp32":
        assert results["auto"] == results["plain"]


def test_held_out_perplexity_of_the_default_stays_within_one_percent(tiny_checkpoint):
    """The embedded KJV model, int8 against fp32, on its held-out chapters (when the corpus can be
    fetched), else on its own README's text."""
    from utils import kjv_corpus

    try:
        texts = kjv_corpus.load().held_out[:3]
    except Exception:
        texts = [(tiny_checkpoint / "README.md").read_text()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    fp32 = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint).eval()
    quantized = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ours = Generator.from_pretrained(tiny_checkpoint, quantize="int8")
    state = {f"transformer.{k}": v for k, v in dequantized_state(ours.model).items()}
    missing = quantized.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys

    def perplexity(model):
        total, count = 0.0, 0
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :512]
            with torch.no_grad():
                total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
        return math.exp(total / count)

    base, int8 = perplexity(fp32), perplexity(quantized)
    print(f"held-out perplexity: fp32 {base:.3f}, int8 {int8:.3f} ({int8 / base - 1:+.2%})")
    assert abs(int8 / base - 1) <= 0.01


def test_bad_quantization_flags_are_one_line(folder, capsys):
    import bloom

    assert bloom.main(["--weights", str(folder), "--quantize", "int8", "--mode", "vanilla", "Hi"]) == 1
    assert "--quantize" in capsys.readouterr().err
    with pytest.raises(QuantizeError, match="unknown quantization"):
        Generator.from_pretrained(folder, quantize="int3")


def test_two_ranks_with_int8_give_one_process_tokens(folder, tmp_path):
    """Row-parallel layers take the whole row's scale (an all-reduce of the row maxima): the same
    int8 weights on 2 ranks as in one process."""
    got = two_rank_tokens(tmp_path, "--weights", str(folder), "--quantize", "int8")
    one = Generator.from_pretrained(folder, quantize="int8")
    want = [r.token_ids for r in one.generate(PROMPTS[1:], max_length=20)]
    assert got == want


# --- a checkpoint saved int8 (utils/quantize_checkpoint.py) ------------------------------------------


@pytest.fixture(scope="module")
def int8_folder(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "int8"
    done = subprocess.run([sys.executable, str(ROOT / "utils" / "quantize_checkpoint.py"), "--weights", str(folder),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def test_a_saved_int8_checkpoint_loads_as_int8_and_gives_the_same_tokens(int8, int8_folder, folder):
    config = json.loads((int8_folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bloom_hpu"
    index = json.loads((int8_folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "h.0.mlp.dense_h_to_4h.qweight" in index and "h.0.mlp.dense_h_to_4h.weight" not in index
    loaded = Generator.from_pretrained(int8_folder)  # int8 without being asked: the checkpoint is
    assert weight_bytes(loaded.model) == weight_bytes(int8.model)
    options = dict(max_length=24, ignore_eos=True)
    assert [r.token_ids for r in loaded.generate(PROMPTS, **options)] == \
        [r.token_ids for r in int8.generate(PROMPTS, **options)]
    again = Generator.from_pretrained(int8_folder, quantize="int8")  # asking for what it is: the same
    assert [r.token_ids for r in again.generate(PROMPTS, **options)] == \
        [r.token_ids for r in int8.generate(PROMPTS, **options)]


def test_two_ranks_read_their_slices_of_a_saved_int8_checkpoint(int8_folder, int8, tmp_path):
    want = [r.token_ids for r in int8.generate(PROMPTS[1:], max_length=20)]
    assert two_rank_tokens(tmp_path, "--weights", str(int8_folder)) == want


def test_checkpoints_quantized_otherwise_or_twice_are_one_line(folder, int8_folder, tmp_path):
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
                            str(int8_folder), "--out", str(tmp_path / "twice")], capture_output=True, text=True)
    assert again.returncode == 1 and "quantized already" in again.stderr


# --- the CPU's int8 kernel, on every build this CPU runs ---------------------------------------------

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


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype, rows", [("fp32", 2), ("bf16", 8)])
def test_the_one_call_int8_step_is_the_int8_model_op_by_op(folder, isa, dtype, rows):
    """decode_step_int8 against the same int8 model's decode op by op: in fp32 (2 rows) the same
    logits; in bf16, 8 rows in one call (the products take the kernel's many-row path, which the
    test above checks against F.linear) the same within bf16's rounding of the two orders of ops."""
    from bloom_hpu.runtime.cpu import CpuOptions

    generator = Generator.from_pretrained(folder, dtype=dtype, quantize="int8", cpu=CpuOptions(path=isa))
    plan = generator.backend.cpu_plan
    assert plan.decode is not None and plan.decode.scales is not None and plan.decode_rows >= rows
    model = generator.model
    cache = model.allocate_cache(rows, 32)
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(4, 200, (rows, 4), generator=g)
    lengths = torch.randint(1, 5, (rows,), generator=g)
    with torch.no_grad():
        model.prefill(ids, lengths, cache)
        tokens, positions = torch.randint(4, 200, (rows, 1), generator=g), lengths.clone()
        one_call = plan.decode(tokens, positions, cache, 16).float()
        with plan.op_by_op():
            op_by_op = model.decode(tokens, positions, cache, 16).float()
    if dtype == "fp32":
        torch.testing.assert_close(one_call, op_by_op, rtol=1e-4, atol=1e-4)
    else:
        scale = op_by_op.abs().max().item()
        torch.testing.assert_close(one_call, op_by_op, rtol=0, atol=0.03 * scale)
        assert (one_call.argmax(-1) == op_by_op.argmax(-1)).float().mean() >= 0.75
