"""Integer products (``--int8_activations``, bloom_hpu/int8_activations.py) against transformers.

The reference: transformers' BloomForCausalLM on the dequantized weights (``q * scale``), every
linear layer's input (the LM head's too) rounded to int8 per block of 32 values by a pre-hook
written here: ``d = max|x| / 127``, ``x -> round(x / d) * d`` in fp32. Through our integer kernel
and through PyTorch's public ops, our greedy tokens are its tokens until its first near tie and our
log-probs close to its (see NEAR_TIE for why not closer), beams are its beams; a batch's rows are
the rows alone; the one-call decode step is the op-by-op one; the CLI, a request file, the server
(the ``openai`` client) and two ranks give the generator's tokens. Then the accuracy contract: the
embedded default's held-out perplexity within 1% (int8) / 5% (int4) of fp32's with the
activations rounded; and the one-line errors.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
import transformers

from bloom_hpu.int8_activations import Int8ActivationsError
from bloom_hpu.runtime.cpu import CpuOptions
from dequantized import held_out_perplexities, write_dequantized
from generation import Generator
from generation.serving.app import make_app
from generation.serving.engine import Engine, EngineConfig
from servers import app_in_thread
from test_quantize import two_rank_tokens

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello, world", "Numbers 1 2 3 4"]
GROUP = 32
MODES = {"int8": dict(quantize="int8"), "int4": dict(quantize="int4", group_size=GROUP)}


def round_per_block(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each block of 32 values rounded to int8 at scale max|x| / 127 (fp32)."""
    blocks = x.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)), 0.0)
    return (q * d).flatten(-2).to(x.dtype)


def with_rounded_inputs(model: transformers.BloomForCausalLM) -> transformers.BloomForCausalLM:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (round_per_block(args[0]),))
    return model


@pytest.fixture(scope="module")
def folder(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=3, n_head=4, seed=7)


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def integer(folder, mode):
    """Through the CPU runtime's fastest path (our integer kernel, where the kernels build)."""
    return Generator.from_pretrained(folder, int8_activations=True, **MODES[mode])


@pytest.fixture(scope="module")
def public_ops(folder, mode):
    """Through PyTorch's public ops alone (the form the cards run)."""
    return Generator.from_pretrained(folder, int8_activations=True, cpu=CpuOptions(path="plain"), **MODES[mode])


@pytest.fixture(scope="module")
def dequantized_folder(folder, integer, tmp_path_factory):
    return write_dequantized(folder, integer.model, tmp_path_factory.mktemp("dequantized"))


@pytest.fixture(scope="module")
def reference(dequantized_folder):
    return with_rounded_inputs(transformers.BloomForCausalLM.from_pretrained(dequantized_folder).eval())


def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their log-probs, and each step's margin (best minus second log-prob)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=3)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    margins = [float(lp.topk(2).values[0] - lp.topk(2).values[1]) for lp in logprobs]
    return tokens, [lp[t].item() for lp, t in zip(logprobs, tokens)], margins


# Rounding is not continuous: the same sum taken in another order (our kernel's blocks, or our
# model's fp32 ops against transformers') can move an activation that lies within a float's noise
# of a rounding boundary by one step, 1/127 of its block's largest value. The result then moves by
# about as much as the rounding itself moves it, which in this small random model (rows of 64) is
# up to a few hundredths of a nat. So our tokens are the reference's until its first near tie, and
# our log-probs are within a tenth of a nat of its.
NEAR_TIE = 0.3  # nats between the best and the second token
LOGPROBS = 0.1


def test_the_runtime_says_integer_products(integer, public_ops, mode):
    from bloom_hpu.runtime.cpu.capability import detect

    assert "integer products" in integer.backend.fast_path
    if detect().kernel_isa is not None:  # the decode step is one C++ call of the same products
        assert f"one-call decode step ({mode}, integer)" in integer.backend.fast_path
    assert "integer products in public ops" in public_ops.backend.fast_path


def test_the_one_call_decode_step_is_the_op_by_op_one(integer):
    """The decode step as one C++ call runs the same integer products as the step op by op."""
    plan = integer.backend.cpu_plan
    if plan is None or plan.decode is None:
        pytest.skip("no one-call decode step on this CPU")
    options = dict(max_new_tokens=12, ignore_eos=True, logprobs=True)
    one_call = integer.generate(PROMPTS, **options)
    with plan.op_by_op():
        op_by_op = integer.generate(PROMPTS, **options)
    assert [r.token_ids for r in one_call] == [r.token_ids for r in op_by_op]
    for a, b in zip(one_call, op_by_op):
        assert a.sequences[0].token_logprobs == pytest.approx(b.sequences[0].token_logprobs, abs=1e-5)


@pytest.mark.parametrize("path", ["kernel", "public ops"])
def test_greedy_tokens_are_transformers_until_a_near_tie(integer, public_ops, reference, path):
    generator = integer if path == "kernel" else public_ops
    compared = 0
    for prompt in PROMPTS:
        ids = generator.tokenizer.encode(prompt)
        result = generator.generate(prompt, max_new_tokens=12, ignore_eos=True, logprobs=True)[0]
        tokens, logprobs, margins = hf_greedy(reference, ids, 12)
        clear = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        assert result.token_ids[:clear] == tokens[:clear]
        assert result.sequences[0].token_logprobs[:clear] == pytest.approx(logprobs[:clear], abs=LOGPROBS)
        compared += clear
    assert compared >= 12  # the comparison is not empty


def test_a_batch_is_each_prompt_alone_and_beams_are_transformers(integer, public_ops, reference):
    """Rows of a batch are rounded each on its own (a block never spans two rows): a batch gives
    each prompt's tokens alone, on both paths; beams are transformers' (this prompt's beams keep
    clear of near ties on this checkpoint)."""
    for generator in (integer, public_ops):
        batch = generator.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert [r.token_ids for r in batch] == [generator.generate(p, max_new_tokens=10)[0].token_ids for p in PROMPTS]
    ids = public_ops.tokenizer.encode(PROMPTS[0])
    ours = public_ops.generate(PROMPTS[0], max_new_tokens=8, num_beams=3, num_return_sequences=2, ignore_eos=True)
    theirs = reference.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=3, num_return_sequences=2,
                                do_sample=False, pad_token_id=3)
    assert [s.token_ids for s in ours[0].sequences] == [row[len(ids):].tolist() for row in theirs]


def test_the_rounding_changes_the_numbers(integer, folder, mode):
    """The mode is not weight-only quantization under another name: the log-probs move."""
    weight_only = Generator.from_pretrained(folder, **MODES[mode])
    kwargs = dict(max_new_tokens=8, ignore_eos=True, logprobs=True)
    a = integer.generate(PROMPTS[0], **kwargs)[0].sequences[0].token_logprobs
    b = weight_only.generate(PROMPTS[0], **kwargs)[0].sequences[0].token_logprobs
    assert a != pytest.approx(b, abs=1e-6)


def test_bf16_runs_on_both_paths(folder, mode):
    """In bf16 each path sums in its own order before the one rounding: both run to the end (the
    kernel with bf16 inputs, the public ops widening them), each batch row as it runs alone."""
    for path in ("auto", "plain"):
        generator = Generator.from_pretrained(folder, dtype="bf16", cpu=CpuOptions(path=path), int8_activations=True,
                                              **MODES[mode])
        batch = [r.token_ids for r in generator.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)]
        assert batch == [generator.generate(p, max_new_tokens=4, ignore_eos=True)[0].token_ids for p in PROMPTS]


def test_the_cli_and_a_request_file_give_the_generators_tokens(folder, integer, mode, tmp_path):
    import bloom

    flags = ["--weights", str(folder), "--int8_activations", *[f for k, v in MODES[mode].items() for f in (f"--{k}", str(v))]]
    out = tmp_path / "out.json"
    assert bloom.main([*flags, "--max_length", "32", "--quiet", "--output_file", str(out), *PROMPTS]) == 0
    want = [r.token_ids for r in integer.generate(PROMPTS, max_length=32)]
    assert [r["token_ids"] for r in json.loads(out.read_text())] == want
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"user": str(i), "prompt": p, "max_tokens": 6, "temperature": 0}) + "\n"
                                for i, p in enumerate(PROMPTS)))
    results = tmp_path / "results.jsonl"
    assert bloom.main([*flags, "--requests", str(requests), "--results", str(results), "--quiet"]) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    got = {r["request"]["user"]: r["result"]["choices"][0]["text"] for r in records}
    assert got == {str(i): integer.generate(p, max_new_tokens=6)[0].text for i, p in enumerate(PROMPTS)}


def test_the_server_answers_with_integer_products(integer):
    """The openai client against a real server on a loopback port: each answer is the generator's."""
    engine = Engine(integer, EngineConfig(max_batch=4, max_length=64, bucket_width=16))
    with app_in_thread(engine, make_app(engine, "base")) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            got = client.completions.create(model="base", prompt=prompt, max_tokens=8, temperature=0)
            assert got.choices[0].text == integer.generate(prompt, max_new_tokens=8)[0].text


@pytest.mark.slow
def test_two_ranks_give_one_process_tokens(folder, tmp_path):
    """int4 (one mode is enough for the launcher): groups and blocks within each rank's half of a row."""
    flags = ["--weights", str(folder), "--int8_activations", "--quantize", "int4", "--group_size", str(GROUP)]
    one_process = Generator.from_pretrained(folder, int8_activations=True, **MODES["int4"])
    want = [r.token_ids for r in one_process.generate(PROMPTS[1:], max_length=20)]
    assert two_rank_tokens(tmp_path, *flags) == want


@pytest.mark.parametrize("mode, within", [("int8", 0.01), ("int4", 0.05)])
def test_held_out_perplexity_of_the_default_stays_close_to_fp32(tiny_checkpoint, mode, within):
    """The embedded KJV model, its weights quantized (int4 at its default group size) and every
    product's input rounded per block, against fp32: on its held-out chapters (when the corpus can be
    fetched), else on its own README's text."""
    ours = Generator.from_pretrained(tiny_checkpoint, quantize=mode, int8_activations=True)
    base, got = held_out_perplexities(tiny_checkpoint, ours.model, with_rounded_inputs)
    print(f"held-out perplexity: fp32 {base:.3f}, {mode} with int8 activations {got:.3f} ({got / base - 1:+.2%})")
    assert abs(got / base - 1) <= within


def test_integer_products_need_quantized_weights(folder, capsys):
    import bloom

    with pytest.raises(Int8ActivationsError, match="goes with quantized weights"):
        Generator.from_pretrained(folder, int8_activations=True)
    assert bloom.main(["--weights", str(folder), "--int8_activations", "Hi"]) == 1
    assert "--int8_activations goes with quantized weights" in capsys.readouterr().err
    assert bloom.main(["--weights", str(folder), "--int8_activations", "--mode", "vanilla", "Hi"]) == 1
    assert "--int8_activations runs in --mode optimized only" in capsys.readouterr().err
