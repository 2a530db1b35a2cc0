"""Every entry point on the graph stand-in (tests/graph_stand_in), as HPU (lazy mode) and as CUDA, with
float weights and with int4 ones.

The stand-in records each captured step and replays the recorded ops on the captured tensors, so a
forgotten input copy, an output read after the next replay or a Python value frozen into a capture
changes the tokens; it refuses host syncs, view writes (HPU) and unsafe random ops (CUDA) while
capturing; on the HPU it hashes lazy mode's eager ops between steps. Each test checks: the tokens
equal the eager CPU run's; after a warm-up run, a second run of the same shapes captures no graph
and (HPU) compiles no lazy graph; nothing was refused (a refusal raises).
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bloom_hpu.runtime.cpu import CpuOptions
from generation.generator import Generator

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Hi", "It was the best of times", "a b c d e f g h i j k", "Hello there, how are you?"]
SEARCHES = {
    "greedy": {},
    "beams": {"num_beams": 3, "num_return_sequences": 2},
    "sampling": {"do_sample": True, "seed": 5, "top_k": 20, "top_p": 0.9, "num_return_sequences": 2},
    "penalties": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 4},
}


# The float weights, and int4 ones (dequantized on the card with public ops; the CPU's kernels off it):
# every entry point runs both.
WEIGHTS = pytest.mark.parametrize("weights", [{}, dict(quantize="int4", group_size=32)], ids=["float", "int4"])


def flags(weights: dict) -> list[str]:
    """``weights`` as command-line flags."""
    return [f for key, value in weights.items() for f in (f"--{key}", str(value))]


@pytest.fixture(scope="module")
def checkpoint(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)


@pytest.fixture(scope="module")
def eager(checkpoint):
    return Generator.from_pretrained(checkpoint, device="cpu")


def on_card(runtime, checkpoint, **kwargs) -> Generator:
    generator = Generator.from_pretrained(checkpoint, device=runtime.device, **kwargs)
    assert type(generator.backend).__name__ == {"hpu": "HpuBackend", "cuda": "CudaBackend"}[runtime.device]
    return generator


def sequences(results):
    return [[s.token_ids for s in r.sequences] for r in results]


def reference(runtime, eager, prompts, **options):
    """The eager CPU generator's sequences (its ops are the host's, not the card's)."""
    with runtime.off_card():
        return sequences(eager.generate(prompts, **options))


EOS = 2  # the random checkpoints' eos_token_id


@pytest.mark.parametrize("search", ["greedy", "beams", "penalties"])
def test_the_eager_reference_is_transformers(checkpoint, eager, search):
    """Every test here compares the card's tokens with the eager CPU run of the same code, so a bug in
    the shared logic would pass them all; this anchors that run to transformers' ``generate`` on the
    same weights, prompts and options (sampling draws from another generator: its own tests)."""
    import torch
    import transformers

    hf = transformers.BloomForCausalLM.from_pretrained(checkpoint).eval()
    options = dict(max_length=24, ignore_eos=False, **SEARCHES[search])
    ours = sequences(eager.generate(PROMPTS, **options))
    for prompt, got in zip(PROMPTS, ours):
        ids = eager.tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_length=24, do_sample=False, eos_token_id=EOS, pad_token_id=3,
                              **{k: v for k, v in SEARCHES[search].items()})
        want = []
        for row in out[:, len(ids):].tolist():
            want.append(row[: row.index(EOS) + 1] if EOS in row else row)  # ours keep ids up to the EOS
        assert got == want, (prompt, search)


class Counts:
    """Captures and lazy graphs so far, to check that a second run adds none."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.captures = runtime.captures
        self.lazy = runtime.lazy.compiles if runtime.lazy else 0

    def unchanged(self) -> bool:
        lazy = self.runtime.lazy.compiles if self.runtime.lazy else 0
        return (self.runtime.captures, lazy) == (self.captures, self.lazy)


# --- Generator.generate: every search ---------------------------------------------------------------


@pytest.mark.parametrize("search", list(SEARCHES))
def test_generate_equals_the_eager_run_and_a_second_run_compiles_nothing(graph_stand_in, checkpoint, eager, search):
    generator = on_card(graph_stand_in, checkpoint)
    options = dict(max_length=24, bucket_width=8, ignore_eos=False, **SEARCHES[search])
    batches = [PROMPTS[:2], PROMPTS[2:]]
    for prompts in batches:
        assert sequences(generator.generate(prompts, **options)) == reference(graph_stand_in, eager, prompts, **options)
    counts = Counts(graph_stand_in)
    # The same shapes again with the rows swapped: every row at other positions, and the same
    # graphs and lazy graphs.
    for prompts in batches:
        prompts = prompts[::-1]
        assert sequences(generator.generate(prompts, **options)) == reference(graph_stand_in, eager, prompts, **options)
    assert counts.unchanged(), (counts.captures, counts.lazy, graph_stand_in.captures, graph_stand_in.lazy and graph_stand_in.lazy.compiles)
    # What the CLI prints as "graphs:" and the server exports as bloom_step_signatures.
    assert generator.last_stats.graph_count == generator.backend.graph_count() == graph_stand_in.captures
    if graph_stand_in.personality == "hpu":  # every step is a graph there; on CUDA the decode steps
        assert len(generator.backend.signatures) == graph_stand_in.captures


@pytest.mark.parametrize("search", ["sampling", "beams"])
@pytest.mark.parametrize("quantize", [dict(quantize="int8"), dict(quantize="int4", group_size=32),
                                      dict(quantize="int4", group_size=32, int8_activations=True)],
                         ids=["int8", "int4", "int4-integer"])
def test_quantized_weights_on_the_card_equal_the_cpus(graph_stand_in, checkpoint, quantize, search):
    """Quantized products dequantize on the card (public ops, captured in the graphs: int4's nibbles
    unpacked by shifts and masks) and call the CPU's kernels on the CPU: the same tokens, and once
    warm, a run captures and compiles nothing. Integer products (``int8_activations``) run their
    public-op form on the card, each block's scale and rounding computed on the device; the CPU
    reference runs the same public ops (the kernel's sums, in another order, may round an
    activation on the other side of a boundary: tests/test_int8_activations.py)."""
    card = on_card(graph_stand_in, checkpoint, **quantize)
    path = "plain" if quantize.get("int8_activations") else "auto"
    cpu = Generator.from_pretrained(checkpoint, device="cpu", cpu=CpuOptions(path=path), **quantize)
    options = dict(max_length=24, bucket_width=8, ignore_eos=False, **SEARCHES[search])
    with graph_stand_in.off_card():
        want = sequences(cpu.generate(PROMPTS, **options))
    assert sequences(card.generate(PROMPTS, **options)) == want  # (its first lazy graph also loads the weights)
    assert sequences(card.generate(PROMPTS, **options)) == want
    counts = Counts(graph_stand_in)
    assert sequences(card.generate(PROMPTS, **options)) == want
    assert counts.unchanged()


def test_more_tokens_add_no_lazy_graph(graph_stand_in, checkpoint, eager):
    """Lazy mode compiles a fixed set of graphs per configuration, not one per token position:
    doubling the tokens of a run (one window: bucket_width 0) compiles nothing new."""
    generator = on_card(graph_stand_in, checkpoint)
    for search in ("greedy", "sampling"):
        options = dict(max_length=40, ignore_eos=True, **SEARCHES[search])
        for _ in range(2):  # the first run's first lazy graph also holds the weights' loading
            generator.generate(PROMPTS[:2], max_new_tokens=10, **options)
        counts = Counts(graph_stand_in)
        ours = generator.generate(PROMPTS[:2], max_new_tokens=20, **options)
        assert sequences(ours) == reference(graph_stand_in, eager, PROMPTS[:2], max_new_tokens=20, **options)
        assert counts.unchanged(), search


def test_growing_windows_are_refused_on_a_graph_runtime(graph_stand_in, checkpoint, eager):
    generator = on_card(graph_stand_in, checkpoint)
    from bloom_hpu.runtime.backends import DeviceError

    with pytest.raises(DeviceError, match="static_shapes=false.*--use_graphs f"):
        generator.generate(PROMPTS[:1], max_length=16, static_shapes=False)
    eagerly = on_card(graph_stand_in, checkpoint, use_graphs=False)
    options = dict(max_length=16, static_shapes=False)
    assert sequences(eagerly.generate(PROMPTS[:2], **options)) == reference(graph_stand_in, eager, PROMPTS[:2], **options)


# --- request files (echo log-probs, n, best_of) and --eval, through the CLI in this process ----------


@WEIGHTS
def test_request_file_and_eval_through_the_cli(graph_stand_in, checkpoint, tmp_path, weights):
    import bloom

    lines = [
        {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True},
        {"prompt": [PROMPTS[0], PROMPTS[2]], "max_tokens": 5, "temperature": 0.8, "n": 2, "seed": 3},
        {"prompt": PROMPTS[3], "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0.7, "best_of": 3, "n": 1, "seed": 4},
    ]
    requests = tmp_path / "in.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    passages = tmp_path / "passages.jsonl"
    passages.write_text("\n".join(json.dumps({"text": p + " and then the end"}) for p in PROMPTS) + "\n")

    def run(device, name):
        results = tmp_path / f"{name}.jsonl"
        assert bloom.main(["--weights", str(checkpoint), "--device", device, *flags(weights), "--requests",
                           str(requests), "--results", str(results), "--budget", "96"]) == 0
        numbers = tmp_path / f"{name}.json"
        assert bloom.main(["--weights", str(checkpoint), "--device", device, *flags(weights), "--eval",
                           str(passages), "--results", str(numbers)]) == 0
        records = [json.loads(line) for line in results.read_text().splitlines()]
        return [r["response"]["choices"] if "response" in r else r for r in records], json.loads(numbers.read_text())

    card, card_eval = run(graph_stand_in.device, "card")
    cpu, cpu_eval = run("cpu", "cpu")
    assert_same(card, cpu)
    assert card_eval["accuracy"] == cpu_eval["accuracy"]
    assert card_eval["perplexity"] == pytest.approx(cpu_eval["perplexity"], rel=1e-5)


def assert_same(ours, theirs, path="") -> None:
    """Equal records: the same texts and ids; floats (log-probs) within float noise (the CPU runs
    its own kernels, the card the model's plain ops); timings ignored, and the prompt tokens the
    prefix cache served (a Gaudi's copies keep to whole blocks, a CPU's take partial ones too)."""
    if isinstance(ours, dict):
        assert set(ours) == set(theirs), path
        for key in ours:
            if "time" not in key and key not in ("created", "id", "seconds", "cached_tokens"):
                assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(ours, float):
        assert ours == pytest.approx(theirs, abs=1e-3), path
    else:
        assert ours == theirs, path


# --- the server's engine: mixed concurrent load, LoRA rows, cancellation ------------------------------


@WEIGHTS
def test_engine_mixed_load_lora_rows_and_cancellation(graph_stand_in, checkpoint, tmp_path, weights):
    from lora_adapters import make_adapter

    from generation.request.parse import parse_request
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    adapter = make_adapter(checkpoint, tmp_path / "adapter", seed=2, r=4, lora_alpha=8)
    # max_prefill 4: the first three requests (four rows) are prefilled in the 4-prompt bucket with a
    # filler row.
    config = EngineConfig(max_batch=4, max_length=48, bucket_width=16, max_prefill=4)

    def serve(generator, threaded=True):
        engine = Engine(generator, config)
        if threaded:
            engine.start()
            assert engine.ready.wait(120)
        else:
            engine.warm_up()
        return engine

    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=9)),
        (PROMPTS[1], SamplingParams(max_tokens=7, temperature=0.8, top_k=5, seed=11, n=2)),
        (PROMPTS[2], SamplingParams(max_tokens=6, logprobs=2, stop=["e f"])),
        (PROMPTS[3], SamplingParams(max_tokens=8, repetition_penalty=1.2, adapter=1)),
        (PROMPTS[0], SamplingParams(max_tokens=6, adapter=1)),
    ]
    # Answered by the batch runner's path between two steps (beams, best_of, echo log-probs).
    offline = [{"prompt": PROMPTS[1], "max_tokens": 5, "n": 2, "best_of": 3, "temperature": 0.9, "seed": 2},
               {"prompt": PROMPTS[2], "max_tokens": 4, "echo": True, "logprobs": 2, "temperature": 0},
               {"prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "num_beams": 2, "n": 2}]

    def answers(engine, threaded=True):
        tok = engine.tokenizer
        handles = [engine.submit(tok.encode(p), params) for p, params in requests]
        others = [engine.submit_offline(parse_request(json.dumps(r), i), [tok.encode(r["prompt"])], adapter=i % 2)
                  for i, r in enumerate(offline)]
        doomed = engine.submit(tok.encode(PROMPTS[2]), SamplingParams(max_tokens=30))
        doomed.cancel()
        if not threaded:  # the scheduler's steps on this thread: the same schedule every time
            while engine.step() or engine.queue_length:
                pass
        out = [[s.token_ids for s in h.result(timeout=120)] for h in handles]
        records = [[e.record for e in h.events(timeout=120) if e.kind == "record"] for h in others]
        return out, records

    lora = {"style": adapter}
    cpu = serve(Generator.from_pretrained(checkpoint, device="cpu", lora=lora, **weights))
    try:
        want = answers(cpu)
    finally:
        cpu.stop()
    card_generator = on_card(graph_stand_in, checkpoint, lora=lora, **weights)
    card = serve(card_generator)  # concurrent arrivals, as a server sees them
    try:
        got = answers(card)
        assert got[0] == want[0]
        assert_same(got[1], want[1])
    finally:
        card.stop()
    # One schedule, twice: after the first, nothing is captured or compiled (no per-token, per-row
    # or per-slot graph), and the tokens are the same.
    before = graph_stand_in.captures
    card = serve(card_generator, threaded=False)
    rows = card.device_rows
    # The count docs/graph-runtimes.md states: a decode graph per (batch bucket, window), a mixed
    # one (decode + a prompt chunk) per (batch bucket, window, chunk bucket), and on HPU a prefill
    # graph per (prefill bucket, length bucket); warm-up captures them all.
    expected = len(rows.batch_sizes) * len(rows.lengths) * (1 + len(rows.segment_counts))
    if graph_stand_in.personality == "hpu":
        expected += len(rows.prefill_sizes) * len(rows.lengths)
    assert graph_stand_in.captures - before == expected
    prefilled, real_prefill = [], rows.prefill
    rows.prefill = lambda prompts, *rest: prefilled.append(len(prompts)) or real_prefill(prompts, *rest)
    assert answers(card, threaded=False)[0] == want[0]
    assert 3 in prefilled  # three prompts in the 4-row prefill: a filler row replayed the same graph
    counts = Counts(graph_stand_in)
    assert answers(card, threaded=False)[0] == want[0]
    assert counts.unchanged(), new_lazy_graphs(graph_stand_in, counts)
    assert card_generator.backend.graph_count() == graph_stand_in.captures


def test_engine_prefill_groups_of_one_bucket_back_to_back(graph_stand_in, checkpoint, eager):
    """A burst onto an idle engine of more requests than max_prefill, every prompt in one length
    bucket: three [2, 16] prefills in a row, replaying one graph on the HPU, where each replay
    overwrites the outputs of the last. The tokens equal the eager CPU engine's and, greedy,
    each request alone: no group's first token is read from a later group's logits."""
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    config = EngineConfig(max_batch=8, max_length=48, bucket_width=16, max_prefill=2)
    prompts = PROMPTS + ["The quick brown fox", "once upon a time"]
    params = [SamplingParams(max_tokens=6 + i % 3) if i % 2 == 0 else
              SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=i) for i in range(len(prompts))]

    def answers(generator) -> tuple[list, list]:
        engine = Engine(generator, config)
        engine.warm_up()
        prefills, real_prefill = [], engine.device_rows.prefill
        engine.device_rows.prefill = lambda group, *rest: prefills.append(
            (len(group), engine.device_rows.length_bucket(max(map(len, group))))) or real_prefill(group, *rest)
        tok = engine.tokenizer
        handles = [engine.submit(tok.encode(p), s) for p, s in zip(prompts, params)]
        while engine.step() or engine.queue_length:
            pass
        return [[s.token_ids for s in h.result(1)] for h in handles], prefills

    card = on_card(graph_stand_in, checkpoint)  # first: it imports the bridge, which off_card reads
    with graph_stand_in.off_card():
        want, cpu_prefills = answers(eager)
    got, prefills = answers(card)
    assert prefills == cpu_prefills == [(2, 16)] * 3  # one bucket, back to back, before any row ran
    assert got == want
    for prompt, s, tokens in zip(prompts, params, got):
        if not s.sampling:
            alone = reference(graph_stand_in, eager, [prompt], max_length=48, max_new_tokens=s.max_tokens,
                              bucket_width=16, ignore_eos=False)
            assert tokens == alone[0], prompt


def new_lazy_graphs(runtime, counts) -> str:
    """What a lazy graph compiled after ``counts`` holds (for a failing test's message)."""
    if runtime.lazy is None:
        return ""
    fresh = list(runtime.lazy.graphs.values())[counts.lazy:]
    return "\n".join(" | ".join(f"{op[0]}{str(op[1])[:60]}" for op in ops[:12]) for ops in fresh[:4])


# --- the chat shell ------------------------------------------------------------------------------------


class Typed:
    def __init__(self, lines):
        self.lines = list(lines)

    def read(self, prompt):
        return self.lines.pop(0) if self.lines else None


@WEIGHTS
def test_chat_shell_replies_equal_the_eager_run(graph_stand_in, checkpoint, eager, weights):
    from generation.chat.settings import Settings, chat_options
    from generation.chat.shell import ChatShell
    from generation.chat.turns import Conversation, turn_format

    def session(generator):
        out = io.StringIO()
        settings = Settings(chat_options(do_sample=False, max_new_tokens=8, max_length=96))
        shell = ChatShell(generator, settings, Conversation(turn_format(generator.tokenizer)),
                          Typed(["Hello there", "Tell me more", "/hyperparameters do_sample=true seed=3", "Again"]),
                          out=out, interruptible=False)
        assert shell.run() == 0
        return out.getvalue()

    cpu = Generator.from_pretrained(checkpoint, device="cpu", **weights) if weights else eager
    assert session(on_card(graph_stand_in, checkpoint, **weights)) == session(cpu)


# --- processes: the CLI, and 2-rank tensor parallelism under the deepspeed launcher -------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@WEIGHTS
@pytest.mark.parametrize("personality", ["hpu", "cuda"])
@pytest.mark.slow
def test_two_ranks_under_deepspeed_equal_one_eager_process(personality, checkpoint, eager, tmp_path, weights):
    prompts = PROMPTS[:3]
    out = tmp_path / "out.json"
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU_", "PT_ENABLE_", "HCL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GRAPH_STAND_IN_REPORT=str(report))
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
               str(_free_port()), str(ROOT / "tests" / "graph_stand_in" / "run_bloom.py"), personality,
               "--weights", str(checkpoint), "--device", personality, "--max_length", "20", "--quiet",
               *flags(weights), "--options", "num_beams=2", "--output_file", str(out), *prompts]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    one = Generator.from_pretrained(checkpoint, device="cpu", **weights) if weights else eager
    want = [r.token_ids for r in one.generate(prompts, max_length=20, num_beams=2)]
    assert [r["token_ids"] for r in json.loads(out.read_text())] == want
    counts = [json.loads(Path(f"{report}.{rank}").read_text()) for rank in (0, 1)]
    assert counts[0] == counts[1] and counts[0]["captures"] >= 1


# --- CUDA specifics ---------------------------------------------------------------------------------


def test_cuda_captures_on_the_steps_own_device(hpu_stand_in, checkpoint, eager, monkeypatch):
    """One process on cuda:1: its warm-up streams and captures are device 1's, never device 0's."""
    from graph_stand_in import cuda, install

    runtime = install("cuda", monkeypatch.setattr)
    generator = Generator.from_pretrained(checkpoint, device="cuda:1")
    assert generator.backend.cuda_index == 1
    options = dict(max_length=16)
    assert sequences(generator.generate(PROMPTS[:2], **options)) == reference(runtime, eager, PROMPTS[:2], **options)
    assert cuda.STATE.devices_used == {1} and all(g.device_index == 1 for g in cuda.STATE.graphs)


def test_released_steps_take_their_graphs_with_them(hpu_stand_in, checkpoint, eager, monkeypatch):
    """Graphs live on their step module: after release_caches a new step captures anew (no graph
    found by a recycled object id replays into freed memory)."""
    import gc

    from graph_stand_in import install

    runtime = install("cuda", monkeypatch.setattr)
    generator = Generator.from_pretrained(checkpoint, device="cuda")
    options = dict(max_length=16)
    want = reference(runtime, eager, PROMPTS[:2], **options)
    for round in range(3):
        assert sequences(generator.generate(PROMPTS[:2], **options)) == want
        assert runtime.captures == round + 1
        generator.runner.release_caches()
        gc.collect()
