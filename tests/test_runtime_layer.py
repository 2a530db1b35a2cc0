"""The split between the model and the runtime: ``bloom_hpu/model.py`` is BLOOM and nothing else,
the runtime applies its fast paths to a finished model, and every pass over the model (scoring
included) is a step the backend sees."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import bloom_hpu.model
from bloom_hpu.config import BloomConfig
from bloom_hpu.model import Linear, StaticBloom
from bloom_hpu.tp import RowParallelLinear
from bloom_hpu.runtime.cpu import CpuOptions, accelerate


def test_the_model_file_imports_nothing_of_the_runtime_and_no_private_op():
    source = Path(bloom_hpu.model.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not any("runtime" in name or "cpu" in name or "habana" in name for name in imported), imported
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    for word in ("mkldnn", "ops", "environ", "avx", "kernel", "cpu", "hpu", "cuda"):
        assert not [n for n in names if word in n.lower()], word


def test_acceleration_swaps_layers_of_a_finished_model_and_can_be_undone_to_op_by_op():
    config = BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)
    model = StaticBloom(config).eval().requires_grad_(False)
    names = [name for name, _ in model.named_parameters()]
    plain_types = {name: type(m) for name, m in model.named_modules()}
    assert all(t.__module__ in ("bloom_hpu.model", "bloom_hpu.tp") or t.__module__.startswith("torch.")
               for t in plain_types.values())
    plan = accelerate(model, CpuOptions())
    assert [name for name, _ in model.named_parameters()] == names  # same parameters, same names
    swapped = {name: type(m) for name, m in model.named_modules()}
    assert swapped.keys() == plain_types.keys()
    for name, module in model.named_modules():
        if isinstance(module, (Linear, RowParallelLinear)) or "dense" in name or "query_key_value" in name:
            assert swapped[name].__name__.startswith("Cpu") and issubclass(swapped[name], plain_types[name])
    with plan.op_by_op():
        attention_types = {type(b.self_attention).__name__ for b in model.h}
        assert attention_types == {"Attention"} and plan.decode is None


def test_scoring_passes_run_as_steps_of_the_backend(make_ckpt):
    from generation.generator import Generator

    generator = Generator.from_pretrained(make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=5))
    generator.generate(["It was the best", "of times"], max_length=24, logprobs=True)
    backend = generator.backend
    assert backend.signatures_of("prefill") and backend.signatures_of("decode")
    assert backend.signatures_of("hidden") and backend.signatures_of("head")
    (hidden,) = backend.signatures_of("hidden")
    ids_shape = hidden[1][0][0]
    assert ids_shape[1] == 24  # the static length (max_length), whatever the rows' lengths


def test_an_unaccelerated_model_computes_what_an_accelerated_one_does(make_ckpt):
    """Plain PyTorch and the fastest path this CPU has: the same greedy tokens (fp32)."""
    from generation.generator import Generator

    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=5)
    plain = Generator.from_pretrained(folder, cpu=CpuOptions(path="plain"))
    fast = Generator.from_pretrained(folder)
    prompts = ["It was the best of times", "Hello"]
    a = plain.generate(prompts, max_length=24)
    b = fast.generate(prompts, max_length=24)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert torch.equal(plain.model.word_embeddings.weight, fast.model.word_embeddings.weight)
