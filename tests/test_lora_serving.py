"""Many LoRA adapters served at once, unmerged: the official ``openai`` client against a real server
on a loopback port. Each row of a batch that mixes adapters must give the tokens of that adapter
merged (``--peft_weights``, itself checked against PEFT in test_lora.py) and run alone, and no mix
of adapters may add a step signature."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from generation import Generator
from generation.serving.app import make_app
from generation.serving.engine import Engine, EngineConfig
from lora_adapters import make_adapter
from servers import app_in_thread, engine_server, free_port

CKPT = dict(hidden_size=64, n_layer=2, n_head=4, seed=7)
MAX_LENGTH, WIDTH = 48, 16
ADAPTERS = {  # different ranks and targets: stacked, they are zero-padded to rank 8
    "qkv": dict(r=2, lora_alpha=4, target_modules=["query_key_value"]),
    "mlp": dict(r=8, lora_alpha=8, target_modules=["dense_h_to_4h", "dense_4h_to_h"]),
    "all": dict(r=4, lora_alpha=8, target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                rank_pattern={"h.1.mlp.dense_4h_to_h": 1}),
}
PROMPTS = ["the cat sat on", "It was the best of times, it was", "a", "Hello world and"]


@pytest.fixture(scope="module")
def folders(make_ckpt, tmp_path_factory):
    base = make_ckpt(**CKPT)
    root = tmp_path_factory.mktemp("served")
    return base, {name: make_adapter(base, root / name, seed=10 + i, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(folders):
    base, adapters = folders
    generator = Generator.from_pretrained(base, device="cpu", lora=adapters)
    with engine_server(generator, "base", max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH) as running:
        yield generator, running.engine, running.port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[2]}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def merged(folders):
    """Each adapter merged into its own generator (None: the base model): the references."""
    base, adapters = folders
    out = {"base": Generator.from_pretrained(base, device="cpu")}
    return out | {name: Generator.from_pretrained(base, device="cpu", peft_weights=f) for name, f in adapters.items()}


def alone(generator, prompt, max_tokens, **options):
    return generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=max_tokens, ignore_eos=False,
                              **options)[0]


def test_models_lists_the_adapters(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["base", "qkv", "mlp", "all"]
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_the_plan_decodes_op_by_op(server):
    generator = server[0]
    plan = generator.backend.cpu_plan
    assert plan is not None and plan.decode is None
    assert "one-call decode step" not in plan.description
    if "kernels" in plan.description:  # the kernels would have given a one-call decode step
        assert "decode op by op (LoRA adapters are served)" in plan.description


def _mixed_round(client, merged, seed: int, names: list[str]):
    rng = random.Random(seed)
    # Arrivals within a few steps of each other, so that rows of different adapters share steps.
    cases = [(rng.choice(names), rng.choice(PROMPTS), rng.randint(4, 16), rng.random() * 0.02) for _ in range(16)]

    def ask(case):
        model, prompt, max_tokens, delay = case
        time.sleep(delay)
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, cases))
    return cases, answers


def test_each_row_of_a_mixed_batch_equals_its_adapter_merged_alone(server, client, merged):
    generator, engine, _ = server
    warm = set(generator.backend.signatures)
    first = _mixed_round(client, merged, 1, ["base", "qkv", "mlp", "all"])
    assert engine.stats["peak_rows"] >= 3  # the adapters really shared steps
    # Another mix of adapters (and batch sizes): still the warm-up's step shapes only.
    second = _mixed_round(client, merged, 2, ["all", "qkv"])
    assert generator.backend.signatures == warm  # before the references add their own shapes
    assert engine.stats["prompts_chunked"] > 0  # some joined in chunks beside rows of other adapters
    texts = {}
    for cases, answers in (first, second):
        for (model, prompt, max_tokens, _), answer in zip(cases, answers):
            ref = alone(merged[model], prompt, max_tokens)
            assert answer.text == ref.text, (model, prompt)
            texts.setdefault(prompt, {})[model] = ref.text
    # The adapters change the text (else this test would prove nothing).
    assert any(len(set(by_model.values())) == len(by_model) > 2 for by_model in texts.values())


def test_the_offline_path_uses_the_adapter(client, merged):
    # Beam search runs through the batch runner's path, in a batch of its own.
    for model in ("all", "base"):
        r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0, n=2,
                                      extra_body={"num_beams": 3})
        ref = alone(merged[model], PROMPTS[1], 6, num_beams=3, num_return_sequences=2)
        assert [c.text for c in r.choices] == [s.text for s in ref.sequences]
        assert r.model == model


def test_engine_rows_carry_their_adapter(server):
    """Directly: the per-row index follows the rows as they join and are compacted."""
    generator, engine, _ = server
    rows = generator.lora.rows
    assert rows.index[: engine.config.max_batch].tolist() == rows.host[: engine.config.max_batch]
    assert torch.equal(rows.index, torch.tensor(rows.host))


@pytest.mark.parametrize("argv, message", [
    (["--lora", "x=y", "Hello"], "--lora goes with --serve"),
    (["--serve", "--lora", "nameonly"], "--lora takes NAME=DIR"),
    (["--serve", "--lora", "a={adapter}", "--lora", "a={adapter}"], "'a' is given twice"),
    (["--serve", "--lora", "a={adapter}", "--peft_weights", "{adapter}"], "cannot be combined with --peft_weights"),
    (["--serve", "--lora", "a={missing}"], "does not exist"),
    (["--serve", "--lora", "{base_name}={adapter}"], "is the base model's name"),
])
def test_bad_lora_flags(folders, tmp_path, capsys, argv, message):
    import bloom

    base, adapters = folders
    values = {"adapter": adapters["qkv"], "missing": tmp_path / "missing", "base_name": base.name}
    argv = ["--weights", str(base), "--port", str(free_port()), *[a.format(**values) for a in argv]]
    assert bloom.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ") and message in err


@pytest.mark.parametrize("dtype, cpu_path", [("fp32", "auto"), ("fp32", "plain"), ("bf16", "auto")])
def test_per_row_steps_equal_each_adapter_merged(folders, dtype, cpu_path):
    """The model's steps directly (no engine): row k of one prefill and one decode uses adapter k,
    on each CPU path (kernels, plain PyTorch; bf16: where the MLP's GELU was fused into the product)."""
    from bloom_hpu.runtime.cpu import CpuOptions
    from bloom_hpu.runtime.cpu.layers import KernelGelu
    from generation.run.batch import make_batch

    base, adapters = folders
    served = Generator.from_pretrained(base, device="cpu", dtype=dtype, lora=adapters, cpu=CpuOptions(path=cpu_path))
    for block in served.model.h:  # an adapter term must come before the GELU, never inside the product
        assert not getattr(block.mlp.dense_h_to_4h, "fused_gelu", False)
        assert isinstance(block.mlp.gelu, (torch.nn.GELU, KernelGelu))  # ATen's or the kernels' threaded one
    names = ["base", *adapters]
    prompts = PROMPTS[: len(names)]
    rows = served.lora.rows
    for k in range(len(names)):
        rows.set(k, k)

    def steps(generator):
        batch = make_batch(generator.tokenizer, prompts, generator.options(max_length=MAX_LENGTH), "cpu")
        cache = generator.runner.cache(len(prompts), MAX_LENGTH)
        first = generator.runner.prefill(batch.input_ids, batch.lengths, cache)
        second = generator.runner.decode(first.argmax(-1)[:, None], batch.lengths, cache, MAX_LENGTH)
        return first.float(), second.float()

    got = steps(served)
    for k, name in enumerate(names):
        options = {} if name == "base" else {"peft_weights": adapters[name]}
        want = steps(Generator.from_pretrained(base, device="cpu", dtype=dtype, cpu=CpuOptions(path=cpu_path),
                                               **options))
        for g, w in zip(got, want):
            if dtype == "fp32":
                torch.testing.assert_close(g[k], w[k], rtol=1e-4, atol=1e-4)
            else:  # merged in fp32 then rounded, against two bf16 products: close, same top token
                assert (g[k] - w[k]).abs().max() < 1.0 and g[k].argmax() == w[k].argmax()
    for k in range(len(names)):
        rows.set(k, 0)


def test_adapters_served_on_int4_weights_are_peft_on_the_dequantized_weights(folders, tmp_path):
    """An int4 base model serving LoRA rows: the base keeps its int4 products, each row's adapter term
    stays in the model's dtype, so a row's tokens are PEFT's on the dequantized base weights."""
    from dequantized import write_dequantized
    from lora_adapters import peft_reference

    base, adapters = folders
    generator = Generator.from_pretrained(base, device="cpu", lora=adapters, quantize="int4", group_size=32)
    dequantized = write_dequantized(base, generator.model, tmp_path / "dequantized")
    engine = Engine(generator, EngineConfig(max_batch=4, max_length=MAX_LENGTH, bucket_width=WIDTH))
    with app_in_thread(engine, make_app(engine, "base")) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        for name in ("all", "mlp"):
            reference = peft_reference(dequantized, adapters[name])
            for prompt in PROMPTS[:2]:
                ids = generator.tokenizer.encode(prompt)
                want = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=3)
                answer = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
                tokens = want[0, len(ids):].tolist()
                eos = generator.tokenizer.eos_token_id
                text = generator.tokenizer.decode(tokens[:tokens.index(eos)] if eos in tokens else tokens)
                assert answer.choices[0].text == text, (name, prompt)
