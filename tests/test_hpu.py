"""The HPU backend against the stand-in for Habana's bridge (tests/graph_stand_in, see its README).

No Gaudi is reachable here. The stand-in keys its graphs the way the bridge does (shape and view
layout), records and replays them, exists only in lazy mode, records the environment it was
imported with, and refuses in-place writes into views while capturing. Every entry point on it,
as HPU and as CUDA, is in test_graph_truth.py. These tests check, on the
CPU, the rules a real card would enforce: one graph per step shape, replayed; warm-up captures what
a run replays; the cache written whole; the environment set before the bridge is imported.
The last tests check the same graph counts on the CUDA backend, where there is a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bloom_hpu.loading import load_model
from bloom_hpu.runtime import backends, hpu_env
from bloom_hpu.runtime.backends import Backend, DeviceError, HpuBackend
from bloom_hpu.runtime.steps import DecodeStep, PrefillStep, StepRunner
from generation.run.batch import BloomTokenizer
from generation.generator import Generator
from generation.request.options import GenerationOptions
from generation.run.warmup import warm_up

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Hi", "It was the best of times", "a b c d e f g h i j k", "Hello there, how are you?", "The"]
SEARCHES = {
    "greedy": {},
    "beams": {"num_beams": 3, "num_return_sequences": 2},
    "sampling": {"do_sample": True, "seed": 5, "top_k": 20, "num_return_sequences": 2},
}


def hpu_generator(folder, **backend_args) -> Generator:
    model, _ = load_model(folder, device="cpu")  # weights first: see the hpu_stand_in fixture
    config = model.config
    tokenizer = BloomTokenizer(folder, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    return Generator(model, tokenizer, StepRunner(model, HpuBackend(device="cpu", **backend_args)), folder)


def graph_caches(kind=None):
    from habana_frameworks.torch.hpu.graphs import GRAPH_CACHES

    names = {"prefill": "PrefillStep", "decode": "DecodeStep"}
    return [c for c in GRAPH_CACHES if kind is None or c.name == names[kind]]


def captures() -> int:
    return sum(c.captures for c in graph_caches())


def replays() -> int:
    return sum(c.replays for c in graph_caches())


def token_ids(results):
    return [[s.token_ids for s in r.sequences] for r in results]


# The environment and lazy mode.

def test_the_bridge_sees_the_hpu_environment_when_the_backend_imports_it(hpu_stand_in):
    HpuBackend(device="cpu")
    seen = hpu_stand_in().IMPORT_ENVIRONMENT
    for key, value in hpu_env.HPU_ENV_DEFAULTS.items():
        assert seen.get(key) == value, key
    assert seen["PT_HPU_LAZY_MODE"] == "1" and seen["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"
    assert "PT_HPU_MAX_COMPOUND_OP_SIZE" not in seen  # only without graphs


def test_tensor_parallel_and_graphless_runs_get_their_flags(hpu_stand_in, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    HpuBackend(device="cpu", use_graphs=False)
    seen = hpu_stand_in().IMPORT_ENVIRONMENT
    assert seen["PT_HPU_LAZY_ACC_PAR_MODE"] == "0" and seen["PT_HPU_MAX_COMPOUND_OP_SIZE"] == "1"


def test_bloom_py_sets_the_environment_before_torch_can_autoload_the_bridge(tmp_path):
    """torch imports every ``torch.backends`` entry point during ``import torch`` (device-backend
    autoload), as Habana's bridge registers itself: the bridge must find the environment set."""
    dist = tmp_path / "habana_stand_in-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: habana-stand-in\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\nhabana = habana_frameworks.autoload:load\n")
    record = tmp_path / "environment.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU_", "PT_ENABLE_", "HCL_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "graph_stand_in" / "bridge"), str(ROOT / "tests"), str(tmp_path), str(ROOT)]),
               HPU_STAND_IN_RECORD=str(record), TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    done = subprocess.run([sys.executable, str(ROOT / "bloom.py"), "--help"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert record.exists(), "torch's autoload did not import the stand-in bridge"
    seen = json.loads(record.read_text())
    for key, value in hpu_env.HPU_ENV_DEFAULTS.items():
        assert seen.get(key) == value, (key, seen)


def test_a_bridge_imported_without_lazy_mode_is_a_clear_error(hpu_stand_in, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    with pytest.raises(DeviceError, match="lazy mode"):
        HpuBackend(device="cpu")
    HpuBackend(device="cpu", use_graphs=False)  # without graphs eager mode is fine


def test_a_bridge_imported_before_the_environment_is_a_clear_error(hpu_stand_in):
    hpu_stand_in()  # as torch's autoload would, before anything set the environment
    with pytest.raises(DeviceError, match="imported before PT_HPU_LAZY_MODE"):
        HpuBackend(device="cpu")


def test_lazy_mode_refuses_int64_values_outside_int32_and_the_sampling_noise_stays_inside(hpu_stand_in):
    """Lazy mode computes int64 as int32 (PT_ENABLE_INT64_SUPPORT is not for lazy mode), so the
    stand-in refuses an int64 value past 2**31; the sampling hash keeps every value below it."""
    from graph_stand_in.lazy import Int64InLazyMode
    from generation.search import sampling

    HpuBackend(device="cpu")
    import habana_frameworks.torch.core as htcore
    htcore.mark_step()  # the tracker follows this thread from its first step on
    with pytest.raises(Int64InLazyMode):
        torch.tensor([1 << 30]) * 4
    keys = torch.tensor([0, 1, sampling._MASK, 123456789])
    noise = sampling.uniform(keys, torch.tensor([1 << 20]), 4096)
    assert 0 < float(noise.min()) and float(noise.max()) < 1
    assert "PT_ENABLE_INT64_SUPPORT" not in hpu_env.HPU_ENV_DEFAULTS


# Graphs: one per step shape, replayed; warm-up captures what the run replays.

@pytest.mark.parametrize("bucket_width", [0, 8])
def test_prompts_of_many_lengths_capture_one_graph_per_step_shape_and_replay_it(hpu_stand_in, tiny_checkpoint,
                                                                               bucket_width):
    reference = Generator.from_pretrained(tiny_checkpoint, device="cpu")
    generator = hpu_generator(tiny_checkpoint)
    options = dict(max_length=24, bucket_width=bucket_width, ignore_eos=True)
    ours = [generator.generate(p, **options)[0].token_ids for p in PROMPTS]
    assert ours == [reference.generate(p, **options)[0].token_ids for p in PROMPTS]
    backend = generator.runner.backend
    # One capture per step shape (a prefill module sees one prompt length per bucket), whatever
    # the prompt lengths; no key captured twice, nothing evicted.
    for kind in ("prefill", "decode"):
        assert sum(c.captures for c in graph_caches(kind)) == len(backend.signatures_of(kind)), kind
    assert all(len(set(c.keys)) == len(c.keys) for c in graph_caches())
    assert sum(c.eager_calls for c in graph_caches()) == 0
    if not bucket_width:
        assert captures() == 2
    else:  # prompts of 1..11 tokens: prompt buckets 8 and 16, windows 8, 16, 24 at most
        assert len(backend.signatures_of("prefill")) == 2 and len(backend.signatures_of("decode")) <= 3
    decodes = sum(24 - len(generator.tokenizer.encode(p)) - 1 for p in PROMPTS)
    assert replays() == len(PROMPTS) + decodes - captures()
    import habana_frameworks.torch.core as htcore
    assert htcore.COUNTS["mark_step"] == len(PROMPTS) + decodes  # one per step
    assert all(c.max_graphs == backends.HPU_MAX_GRAPHS for c in graph_caches())


@pytest.mark.parametrize("search", list(SEARCHES))
def test_warm_up_captures_every_graph_a_run_replays(hpu_stand_in, tiny_checkpoint, search):
    generator = hpu_generator(tiny_checkpoint)
    options = GenerationOptions(max_length=20, bucket_width=8, ignore_eos=True, **SEARCHES[search])
    warm_up(generator, options, [2])
    warmed, replayed = captures(), replays()
    keys = {key for c in graph_caches() for key in c.keys}
    generator.generate(PROMPTS[:2], options)
    generator.generate(PROMPTS[2:4], options)
    assert captures() == warmed, "the run captured graphs warm-up did not"
    assert {key for c in graph_caches() for key in c.keys} == keys
    assert replays() > replayed


@pytest.mark.parametrize("search", list(SEARCHES))
def test_outputs_equal_the_cpu_path(hpu_stand_in, tiny_checkpoint, search):
    reference = Generator.from_pretrained(tiny_checkpoint, device="cpu")
    generator = hpu_generator(tiny_checkpoint)
    options = GenerationOptions(max_length=20, ignore_eos=False, **SEARCHES[search])
    assert token_ids(generator.generate(PROMPTS, options)) == token_ids(reference.generate(PROMPTS, options))
    assert all(c.captures == 1 for c in graph_caches())


def test_the_cache_is_one_tensor_per_layer_written_whole(hpu_stand_in, tiny_checkpoint):
    """HPU graphs refuse in-place writes into views: the stand-in raises if a step makes one."""
    generator = hpu_generator(tiny_checkpoint)
    generator.generate(PROMPTS[:2], max_length=16, num_beams=2)
    caches = list(generator.runner._caches.values())  # the beams' cache and the prompts' one
    assert len(caches) == 2
    for cache in caches:
        assert cache.per_layer and len(cache.flat_keys) == generator.runner.model.config.n_layer
        assert all(not t._is_view() for t in cache.flat_keys + cache.flat_values)
        assert len({t.data_ptr() for t in cache.flat_keys + cache.flat_values}) == 2 * len(cache.flat_keys)


def test_under_tensor_parallelism_the_prefill_runs_without_a_graph(hpu_stand_in, tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint, device="cpu")
    backend = HpuBackend(device="cpu")
    backend.prepare_model(SimpleNamespace(parallel=SimpleNamespace(world_size=2), modules=lambda: []))
    cache = model.allocate_cache(1, 8, per_layer=True)
    prefill, decode = PrefillStep(model, cache, backend), DecodeStep(model, cache, 8)
    backend.prepare(prefill)
    backend.prepare(decode)
    assert [c.name for c in graph_caches()] == ["DecodeStep"]


def test_hpu_without_graphs_wraps_nothing(hpu_stand_in, tiny_checkpoint):
    generator = hpu_generator(tiny_checkpoint, use_graphs=False)
    generator.generate("Hello", max_length=12)
    import habana_frameworks.torch.core as htcore
    assert graph_caches() == [] and htcore.COUNTS["mark_step"] > 0


def test_prefill_trimming_is_left_off_where_every_shape_is_a_graph(hpu_stand_in):
    """A Gaudi compiles a graph per shape, so its prefill keeps the static [B, P]; CPU and CUDA run
    prefill eagerly and trim it (CUDA is only constructed here: nothing runs on it)."""
    for backend, trims in ((HpuBackend(device="hpu"), False), (Backend("cuda"), True), (Backend("cpu"), True)):
        assert backend.trim_prefill is trims, backend.device


# The same counts on CUDA graphs (decode steps only are captured there). No GPU here: skipped.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_captures_one_decode_graph_per_shape_for_many_prompt_lengths(tiny_checkpoint):
    reference = Generator.from_pretrained(tiny_checkpoint, device="cpu")
    generator = Generator.from_pretrained(tiny_checkpoint, device="cuda")
    backend = generator.runner.backend
    for bucket_width in (0, 8):
        options = dict(max_length=24, bucket_width=bucket_width, ignore_eos=True)
        ours = [generator.generate(p, **options)[0].token_ids for p in PROMPTS]
        assert ours == [reference.generate(p, **options)[0].token_ids for p in PROMPTS]
    assert backend.graph_count() == len(backend.signatures_of("decode"))


@needs_cuda
@pytest.mark.parametrize("search", list(SEARCHES))
def test_cuda_warm_up_captures_every_graph_a_run_replays(tiny_checkpoint, search):
    generator = Generator.from_pretrained(tiny_checkpoint, device="cuda")
    options = GenerationOptions(max_length=20, bucket_width=8, ignore_eos=True, **SEARCHES[search])
    warm_up(generator, options, [2])
    graphs = generator.runner.backend.graph_count()
    assert graphs >= 1
    generator.generate(PROMPTS[:2], options)
    assert generator.runner.backend.graph_count() == graphs


def test_limit_hpu_graphs_runs_the_prefill_without_a_graph(hpu_stand_in, tiny_checkpoint, monkeypatch):
    """Habana's first-token bypass, by choice on one card (by default under tensor parallelism)."""
    from graph_stand_in import install

    install("hpu", monkeypatch.setattr)
    generator = Generator.from_pretrained(tiny_checkpoint, device="hpu", limit_hpu_graphs=True)
    generator.generate(PROMPTS[:2], max_length=16)
    assert [c.name for c in graph_caches()] == ["DecodeStep"]
    assert generator.backend.graph_count() == 1 == captures()
