"""The CPU routes chosen by measurement (bloom_hpu/runtime/cpu/choice.py, routes.py; DESIGN.md
principle 15) and the accuracy contract every route keeps (docs/performance.md#the-routes-chosen-by-measurement).

* The choice is timed once and cached in a file named by what determines it; a killed first run
  leaves no file (nor a half-written one that is read), and the next run times again and writes
  one complete file.
* ``CpuOptions.choice`` / ``$BLOOM_CPU_CHOICE`` force a route or skip the timing; a route that
  cannot run here is one clear error.
* The contract, on the embedded default (checkpoints/bloom-tiny), for the route the timing takes
  and for each route forced: held-out perplexity through our own products within 1% (int8) / 5%
  (int4) of fp32's; greedy tokens are transformers' on the dequantized weights until the
  reference's first near tie (NEAR_TIE nats between its best and second token) and the log-probs
  within LOGPROBS nats of its; with the AVX2 build and torch, oneDNN and MKL capped at AVX2 too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers

from bloom_hpu.runtime.cpu import CpuOptions, CpuPathError, accelerate, capability, choice, routes
from bloom_hpu.runtime.cpu.routes import PROMPT_KEYS, RowRoutes
from bloom_hpu.tp import DistributedParallel
from dequantized import write_dequantized
from generation import Generator
from generation.run.logprobs import score_rows
from bloom_hpu.quantize import quantized_products
from isas import KERNEL_ISAS, ROOT, needs_isa

PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "Blessed are the", "And it came to pass",
           "The LORD is my shepherd", "Thou shalt not"]
NEW_TOKENS = 24
# The rounding of the activations moves the embedded default's log-probs by up to ~0.035 nats
# against the weight-only reference (measured on every route; weight-only routes by ~1e-5): a step
# whose best two tokens lie closer than NEAR_TIE may flip, and ends the comparison of that prompt.
NEAR_TIE = 0.05  # nats
LOGPROBS = 0.1  # nats
PERPLEXITY = {"int8": 0.01, "int4": 0.05}  # relative to fp32's
# Every pair of routes a quantized fp32 model can be forced to, besides the measured one ('widened'
# is a route of bf16 and fp16 models: test_bf16_routes_keep_the_contract).
FORCED = ["prompts=native,decode=weight-only", "prompts=native,decode=integer",
          "prompts=integer,decode=weight-only", "prompts=integer,decode=integer"]


QUIET = (0.0, 0.0, 0.0)
BUSY = (4.0 * (os.cpu_count() or 1), 0.0, 0.0)  # 1-minute load average: 4 per CPU


@pytest.fixture
def choice_dir(tmp_path, monkeypatch):
    """An empty folder for the cached choices, on a machine that reads as quiet (the timing's
    load rule is tested apart: test_a_pick_timed_on_a_busy_machine_is_timed_again_when_quiet)."""
    folder = tmp_path / "choices"
    folder.mkdir()
    monkeypatch.setenv(choice.DIR_ENV, str(folder))
    monkeypatch.setattr(os, "getloadavg", lambda: QUIET)
    return folder


def counting(times: dict[str, float]):
    """Candidates that 'take' the given seconds, and the count of calls made to them."""
    calls = {name: 0 for name in times}

    def candidate(name):
        def run():
            calls[name] += 1
            return times[name]
        return run

    return {name: candidate(name) for name in times}, calls


# --- the cache ---------------------------------------------------------------------------------


def test_the_file_is_named_by_what_determines_it(choice_dir, monkeypatch):
    base = choice.cache_path({"dtype": "bf16", "sample": [[1024, 4096]]})
    assert base == choice.cache_path({"dtype": "bf16", "sample": [[1024, 4096]]})
    assert base.parent == choice_dir and base.name.startswith("bloom_cpu_choice_")
    others = {choice.cache_path({"dtype": "fp32", "sample": [[1024, 4096]]}),
              choice.cache_path({"dtype": "bf16", "sample": [[2048, 4096]]})}
    given = os.environ.get("ONEDNN_MAX_CPU_ISA")  # the suite may run capped (README: as an AVX2 CPU)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41" if given == "AVX2" else "AVX2")
    others.add(choice.cache_path({"dtype": "bf16", "sample": [[1024, 4096]]}))
    if given is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", given)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        others.add(choice.cache_path({"dtype": "bf16", "sample": [[1024, 4096]]}))
    finally:
        torch.set_num_threads(threads)
    assert base == choice.cache_path({"dtype": "bf16", "sample": [[1024, 4096]]})
    assert len(others) == 4 and base not in others


def test_the_fastest_is_timed_once_then_read(choice_dir):
    runs, calls = counting({"native": 2.0, "widened": 1.0})
    first = choice.choose({"prompts": runs}, {"prompts": "native"}, {"k": 1}, "measure")
    assert first.how == "measured" and first.picks == {"prompts": "widened"}
    assert calls == {"native": 1 + choice.REPEATS, "widened": 1 + choice.REPEATS}
    files = list(choice_dir.glob("bloom_cpu_choice_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["picks"] == {"prompts": "widened"}
    runs, calls = counting({"native": 2.0, "widened": 1.0})
    again = choice.choose({"prompts": runs}, {"prompts": "native"}, {"k": 1}, "measure")
    assert again.how == "cached" and again.picks == {"prompts": "widened"}
    assert sum(calls.values()) == 0  # read, not timed


def test_a_candidate_slowed_by_other_work_in_most_rounds_still_wins(choice_dir):
    """Other work on the machine only adds time: the faster candidate, disturbed in 3 of its 5
    rounds (1.5 s instead of 1.0), still beats one that takes 1.2 s every round (its median would not)."""
    seconds = {"native": iter([1.0, 1.5, 1.0, 1.5, 1.5, 1.0]), "widened": iter([1.2] * 6)}
    runs = {name: (lambda name=name: next(seconds[name])) for name in seconds}
    picked = choice.choose({"prompts": runs}, {"prompts": "widened"}, {"k": 4}, "measure")
    assert picked.picks == {"prompts": "native"} and picked.times["prompts"]["native"] == 1.0


def test_a_slow_candidate_is_dropped_after_its_warm_up(choice_dir):
    runs, calls = counting({"native": 5.0, "widened": 1.0, "integer": 2.0})
    picked = choice.choose({"prompts": runs}, {"prompts": "native"}, {"k": 2}, "measure")
    assert picked.picks == {"prompts": "widened"}
    assert calls == {"native": 2, "widened": 1 + choice.REPEATS, "integer": 1 + choice.REPEATS}


def test_a_candidate_slow_only_in_its_first_call_is_timed_and_wins():
    """A first call 5x slower than the others' (a page fault, a thread waking) is not the
    candidate's time: it is called again, timed in the rounds, and wins where it is fastest; its
    time, summed over a class, cannot turn the class's choice either."""
    seconds = {"integer": iter([5.0] + [0.9] * 6), "weight-only": iter([1.0] * 7)}
    runs = {name: (lambda name=name: next(seconds[name])) for name in seconds}
    times = choice.measure(runs)
    assert times == {"integer": 0.9, "weight-only": 1.0}
    buckets = {"prompts:17-64": times, "prompts:65+": {"integer": 0.9, "weight-only": 1.0}}
    assert set(choice.settle(buckets, together=("integer",)).values()) == {"integer"}


def test_a_damaged_file_is_timed_again(choice_dir):
    runs, calls = counting({"native": 1.0, "widened": 2.0})
    path = choice.cache_path({"k": 3, "candidates": {"prompts": ["native", "widened"]}})
    path.write_text('{"picks": {"prom')
    assert choice.choose({"prompts": runs}, {"prompts": "widened"}, {"k": 3}, "measure").how == "measured"
    assert json.loads(path.read_text())["picks"] == {"prompts": "native"}


KILLED_RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from bloom_hpu.runtime.cpu import choice
    marker = Path(sys.argv[1])
    def slow():
        marker.touch()  # the measurement has begun
        time.sleep(60)
        return 1.0
    choice.choose({"prompts": {"native": slow, "widened": lambda: 2.0}}, {"prompts": "native"}, {"k": 4}, "measure")
""")


def test_a_killed_first_run_leaves_nothing_and_the_next_times_again(choice_dir, tmp_path):
    marker = tmp_path / "timing"
    process = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(marker)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the timing never began"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not list(choice_dir.glob("bloom_cpu_choice_*"))
    # A writer killed between its write and its rename: a temporary file, never read.
    path = choice.cache_path({"k": 4, "candidates": {"prompts": ["native", "widened"]}})
    leftover = path.parent / f".{path.stem}.x1y2.tmp"
    leftover.write_text('{"picks": {"prompts": "wid')
    runs, calls = counting({"native": 1.0, "widened": 2.0})
    picked = choice.choose({"prompts": runs}, {"prompts": "widened"}, {"k": 4}, "measure")
    assert picked.how == "measured" and picked.picks == {"prompts": "native"} and calls["native"] > 1
    assert [p.name for p in choice_dir.iterdir()] == [path.name]  # one complete file, no temporary
    assert json.loads(path.read_text())["picks"] == {"prompts": "native"}


def test_a_pick_timed_on_a_busy_machine_is_timed_again_when_quiet(choice_dir, monkeypatch):
    load = {"now": BUSY}
    monkeypatch.setattr(os, "getloadavg", lambda: load["now"])
    key = {"k": 6}

    def run(times):
        runs, calls = counting(times)
        return choice.choose({"prompts": runs}, {"prompts": "native"}, key, "measure"), calls

    busy, _ = run({"native": 2.0, "widened": 1.0})
    assert (busy.how, busy.provisional, busy.picks) == ("measured", True, {"prompts": "widened"})
    assert busy.describe() == "prompts widened (measured, provisional)"
    saved = json.loads(busy.path.read_text())
    assert saved["provisional"] is True and saved["load_average"] == BUSY[0] and saved["cpus"] == os.cpu_count()
    assert abs(saved["timed_at"] - time.time()) < 600
    still_busy, calls = run({"native": 1.0, "widened": 2.0})  # busy again: kept, not timed
    assert (still_busy.how, still_busy.provisional, sum(calls.values())) == ("cached", True, 0)
    load["now"] = QUIET
    quiet, calls = run({"native": 1.0, "widened": 2.0})  # quiet: timed again, and final
    assert (quiet.how, quiet.provisional, quiet.picks) == ("measured", False, {"prompts": "native"})
    assert calls["native"] > 1 and json.loads(quiet.path.read_text())["provisional"] is False
    load["now"] = BUSY
    final, calls = run({"native": 2.0, "widened": 1.0})
    assert (final.how, final.provisional, final.picks, sum(calls.values())) == ("cached", False, {"prompts": "native"}, 0)


# --- prompt buckets and decode rows ------------------------------------------------------------


def test_each_prompt_bucket_keeps_its_fastest(choice_dir):
    times = {PROMPT_KEYS[0]: {"native": 1.0, "widened": 2.0, "kernel": 1.5},
             PROMPT_KEYS[1]: {"native": 2.0, "widened": 1.0, "kernel": 1.5},
             PROMPT_KEYS[2]: {"native": 2.0, "widened": 1.5, "kernel": 1.0},
             "decode": {"native": 1.0, "widened": 2.5}}
    runs = {key: counting(t)[0] for key, t in times.items()}
    static = {key: "native" for key in times}
    picked = choice.choose(runs, static, {"k": 7}, "measure")
    assert picked.picks == {PROMPT_KEYS[0]: "native", PROMPT_KEYS[1]: "widened", PROMPT_KEYS[2]: "kernel",
                            "decode": "native"}
    assert picked.describe() == "prompts 1-16 native, 17-64 widened, 65+ kernel, decode native (measured)"
    assert choice.choose(runs, static, {"k": 7}, "measure").picks == picked.picks  # read back per bucket


def test_integer_products_go_to_every_prompt_bucket_or_none():
    """Integer products are not within float tolerance of the others: picked by the sum over the
    buckets, so that a prompt's tokens do not depend on the prompts batched with it."""
    def times(integer):
        return {k: {"native": 1.0, "integer": t} for k, t in zip(PROMPT_KEYS, integer)} | \
            {"decode": {"weight-only": 1.0, "integer": 0.5}}

    settled = choice.settle(times([0.5, 2.0, 2.0]), routes.TOGETHER)  # faster in one bucket only
    assert [settled[k] for k in PROMPT_KEYS] == ["native"] * 3 and settled["decode"] == "integer"
    settled = choice.settle(times([0.5, 0.5, 1.5]), routes.TOGETHER)  # faster in sum
    assert [settled[k] for k in PROMPT_KEYS] == ["integer"] * 3
    keys = {k: ["native", "widened", "integer"] for k in PROMPT_KEYS}
    static = {k: "native" for k in keys}
    assert choice.forced_picks(choice.parse_forced("prompts:65+=widened"), keys, static, routes.TOGETHER) == \
        {PROMPT_KEYS[0]: "native", PROMPT_KEYS[1]: "native", PROMPT_KEYS[2]: "widened"}
    with pytest.raises(choice.ChoiceError, match="integer products go to every prompts bucket or none"):
        choice.forced_picks(choice.parse_forced("prompts:1-16=integer"), keys, static, routes.TOGETHER)
    with pytest.raises(choice.ChoiceError, match="no such bucket; choose one of prompts:1-16"):
        choice.forced_picks(choice.parse_forced("prompts:3-5=native"), keys, static, routes.TOGETHER)


def test_a_class_forced_goes_to_its_buckets_that_offer_the_candidate():
    """'prompts=onednn' where the 1-16 bucket offers 'native' and 'widened' alone (the few-rows
    kernel multiplies those rows whatever the route): the buckets past 16 rows take it, 1-16 its
    static pick; named for that bucket, or for a class no bucket of which offers it, an error."""
    keys = {PROMPT_KEYS[0]: ["native", "widened"]} | \
        {k: ["native", "widened", "kernel", "onednn"] for k in PROMPT_KEYS[1:]} | {"decode": ["native", "widened"]}
    static = {k: "native" for k in keys}
    assert choice.forced_picks(choice.parse_forced("prompts=onednn"), keys, static, routes.TOGETHER) == \
        {PROMPT_KEYS[0]: "native", PROMPT_KEYS[1]: "onednn", PROMPT_KEYS[2]: "onednn", "decode": "native"}
    with pytest.raises(choice.ChoiceError, match="prompts:1-16=kernel cannot run here: choose one of native, widened"):
        choice.forced_picks(choice.parse_forced("prompts:1-16=kernel"), keys, static, routes.TOGETHER)
    with pytest.raises(choice.ChoiceError, match="decode=onednn cannot run here"):
        choice.forced_picks(choice.parse_forced("decode=onednn"), keys, static, routes.TOGETHER)
    with pytest.raises(choice.ChoiceError, match="prompts:1-16=integer cannot run here"):
        choice.forced_picks(choice.parse_forced("prompts=integer"), keys, static, routes.TOGETHER)


def test_a_products_route_is_its_class_and_its_rows_bucket():
    picks = RowRoutes(("native", "widened", "kernel"), "decode-pick")
    k = 8
    for shape, route in [((1, 8, k), "native"), ((2, 8, k), "native"), ((1, 16, k), "native"), ((1, 17, k), "widened"),
                         ((2, 32, k), "widened"), ((1, 65, k), "kernel"), ((2, 40, k), "kernel"),
                         ((1, 1, k), "decode-pick"), ((16, 1, k), "decode-pick"), ((8, k), "decode-pick"),
                         ((17, 1, k), "widened"), ((80, k), "kernel")]:
        assert picks.pick(torch.zeros(shape)) == route, shape


def small_bf16_model(mode=None):
    from bloom_hpu.config import BloomConfig
    from bloom_hpu.model import StaticBloom
    from bloom_hpu.quantize import quantize
    from utils.random_checkpoint import random_weights

    config = BloomConfig(vocab_size=1024, hidden_size=64, n_layer=2, n_head=4)
    model = StaticBloom(config)
    model.load_state_dict(random_weights(config, live_vocab=1000, seed=4, weight_scale=1.0))
    model = model.bfloat16().eval().requires_grad_(False)
    return quantize(model, mode, 32 if mode == "int4" else None) if mode else model


class Spy:
    def __init__(self, fn):
        self.fn, self.rows = fn, []

    def __call__(self, x, *args, **kwargs):
        self.rows.append(x.numel() // x.shape[-1])
        return self.fn(x, *args, **kwargs)


@pytest.mark.parametrize("mode", [None, "int8"])
def test_each_bucket_and_the_decode_rows_run_their_own_route(choice_dir, mode):
    """Forced per bucket: only the rows of the widened buckets (and, for bf16 weights, the widened
    decode rows) reach the widened products, whatever the kernel would serve; a widened decode
    takes the decode op by op (the one-call step multiplies through the kernel)."""
    model = small_bf16_model(mode)
    decode = "widened" if mode is None else "weight-only"
    forced = f"prompts:1-16=widened,prompts:17-64=native,prompts:65+=widened,decode={decode}"
    plan = accelerate(model, CpuOptions(choice=forced))
    assert plan.description.endswith(f"routes prompts 1-16 widened, 17-64 native, 65+ widened, decode {decode} (forced)")
    assert "weights widened" in plan.description
    linear = model.h[0].mlp.dense_4h_to_h
    spy = Spy(linear.wide.quantized if mode else linear.wide.linear)
    setattr(linear.wide, "quantized" if mode else "linear", spy)
    with torch.no_grad():
        for shape in [(1, 8), (1, 40), (1, 100), (4, 1), (32, 1)]:
            linear(torch.randn(*shape, linear.in_features).bfloat16())
    assert spy.rows == ([8, 100, 4] if mode is None else [8, 100])
    if mode is None:
        assert plan.decode is None
        if model.head.wide is not None:  # the head's decode rows are never widened (it is not timed)
            with torch.no_grad():
                model.head(torch.randn(4, 64).bfloat16(), model.word_embeddings.weight)
                model.head(torch.randn(1, 100, 64).bfloat16(), model.word_embeddings.weight)
            assert spy.rows == [8, 100, 4, 100]
    elif "kernels" in plan.description:
        assert plan.decode is not None


@pytest.mark.slow
@pytest.mark.parametrize("route", ["prompts=widened,decode=widened", "prompts=native,decode=widened"])
def test_a_widened_decode_is_transformers_greedy(tiny_checkpoint, choice_dir, route):
    """bf16 weights, the decode rows on the widened fp32 products: greedy tokens are transformers'
    in bf16 on the same weights until the reference's first near tie (where the two roundings of
    the sums may flip the token)."""
    generator = Generator.from_pretrained(tiny_checkpoint, dtype="bf16", cpu=CpuOptions(choice=route))
    assert "decode rows)" in generator.backend.fast_path and generator.backend.cpu_plan.decode is None
    reference = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).eval()
    compared = 0
    for prompt in PROMPTS:
        ids = generator.tokenizer.encode(prompt)
        result = generator.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)[0]
        tokens, _, margins = hf_greedy(reference, ids, NEW_TOKENS)
        clear = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        assert result.token_ids[:clear] == tokens[:clear], prompt
        compared += clear
    print(f"{route}: {compared} greedy tokens compared")
    assert compared >= 2 * NEW_TOKENS


def test_fp32_prompts_on_onednns_product_are_transformers_greedy(tiny_checkpoint, choice_dir, monkeypatch):
    """fp32 weights offer a prompt route 'onednn' (oneDNN's product on the plain weight, where torch's
    F.linear is MKL's), timed with the others; forced, a prompt's products of more than 16 rows run
    there, and greedy tokens and log-probs are transformers' fp32 ones until its first near tie."""
    if not capability.onednn_plain_linear(torch.float32):
        pytest.skip("oneDNN's linear does not take a plain fp32 weight here")
    measured = Generator.from_pretrained(tiny_checkpoint, cpu=CpuOptions(choice="measure"))  # times the routes
    files = [json.loads(f.read_text())["times"] for f in choice_dir.glob("bloom_cpu_choice_*.json")]
    timed = next(t for t in files if PROMPT_KEYS[1] in t)  # the routes' file (the prefetch has its own)
    assert all("onednn" in timed[key] for key in PROMPT_KEYS[1:]), timed
    # Up to 16 rows the few-rows kernel multiplies whatever the route: one candidate, not timed.
    assert PROMPT_KEYS[0] not in timed, timed
    assert re.search(r"routes prompts (1-16 )?native", measured.backend.fast_path), measured.backend.fast_path
    del measured
    from bloom_hpu.runtime.cpu import layers

    rows = []
    real = layers.onednn_product

    def spy(x, *args):
        rows.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(layers, "onednn_product", spy)
    generator = Generator.from_pretrained(tiny_checkpoint, cpu=CpuOptions(choice="prompts=onednn"))
    assert "routes prompts 1-16 native, 17-64 onednn, 65+ onednn, decode native (forced)" in generator.backend.fast_path
    reference = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint).eval()
    compared = 0
    for prompt in PROMPTS + [" ".join(PROMPTS)]:  # the last one past 16 tokens
        ids = generator.tokenizer.encode(prompt)
        result = generator.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)[0]
        tokens, logprobs, margins = hf_greedy(reference, ids, NEW_TOKENS)
        clear = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        assert result.token_ids[:clear] == tokens[:clear], prompt
        assert result.sequences[0].token_logprobs[:clear] == pytest.approx(logprobs[:clear], abs=1e-4)
        compared += clear
    assert compared >= 2 * NEW_TOKENS
    assert rows and max(rows) > 16  # the long prompt's products ran on oneDNN's


# --- tensor parallelism: one choice for every rank ---------------------------------------------


def test_every_rank_takes_rank_0s_choice(monkeypatch):
    sent = {}

    def broadcast(objects, group=None, group_src=None):  # a two-rank group's broadcast, from rank 0
        assert group_src == 0 and group == "the model's group"
        if "value" in sent:
            objects[0] = sent["value"]
        else:
            sent["value"] = objects[0]

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    ranks = [DistributedParallel(rank=r, world_size=2, group="the model's group") for r in (0, 1)]
    mine = {0: choice.Chosen({"prompts": "widened"}, "measured", {}), 1: choice.Chosen({"prompts": "native"}, "measured", {})}
    decided = []

    def decide(rank):
        decided.append(rank)
        return mine[rank]

    got = [choice.agree(p, lambda r=p.rank: decide(r)) for p in ranks]
    assert got == [mine[0], mine[0]] and decided == [0]  # rank 1 neither times nor keeps its own
    sent.clear()

    def cannot():
        raise choice.ChoiceError("CPU choice prompts=integer cannot run here")

    for p in ranks:  # rank 0's error is every rank's
        with pytest.raises(choice.ChoiceError, match="prompts=integer cannot run here"):
            choice.agree(p, cannot)
    assert choice.agree(DistributedParallel(rank=0, world_size=1), lambda: mine[1]) == mine[1]  # no broadcast


TWO_RANKS = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from bloom_hpu.runtime.cpu import choice
    from bloom_hpu.tp import DistributedParallel
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    os.environ[choice.DIR_ENV] = sys.argv[3]
    os.getloadavg = lambda: (0.0, 0.0, 0.0)
    # each rank would time a different winner
    times = {"native": 1.0 + rank, "widened": 2.0 - rank}
    runs = {name: (lambda t=t: t) for name, t in times.items()}
    group = dist.new_group([0, 1])
    chosen = choice.agree(DistributedParallel(rank=rank, world_size=2, group=group),
                          lambda: choice.choose({"prompts": runs}, {"prompts": "native"}, {"rank": rank}, "measure"))
    print("picked", chosen.picks["prompts"], chosen.how)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_gloo_ranks_route_alike(tmp_path):
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), str(store), str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["picked native measured"] * 2  # rank 0's pick on both
    assert len(list(tmp_path.glob("bloom_cpu_choice_*.json"))) == 1  # only rank 0 timed and wrote


@pytest.mark.slow
def test_two_deepspeed_ranks_load_with_rank_0s_routes(make_ckpt, tmp_path):
    """bloom.py on two ranks (gloo), bf16 so that the routes have candidates, measured: both ranks
    print the same routes and weight prefetch, and one choice file of each is written (rank 0's)."""
    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "BLOOM_CPU_CHOICE": "measure",
           choice.DIR_ENV: str(tmp_path)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               "bloom.py", "--weights", str(folder), "--dtype", "bf16", "--all_ranks", "--max_length", "12", "Hi"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    lines = [line for line in log.splitlines() if "CPU fast path" in line]
    routes_seen = {line.rsplit("; routes ", 1)[-1] for line in lines}
    assert len(lines) == 2 and len(routes_seen) == 1 and "routes prompts" in lines[0], lines
    prefetch_seen = {line.split("weight prefetch ", 1)[1].split(" (", 1)[0] for line in lines}  # 'none, l2 from 2 rows'
    assert len(prefetch_seen) == 1 and re.match(r"\w+", *prefetch_seen).group() in capability.PREFETCH_KINDS, lines
    files = [json.loads(path.read_text()) for path in tmp_path.glob("bloom_cpu_choice_*.json")]
    prefetch_files = sorted(any(key.startswith("prefetch:") for key in f["picks"]) for f in files)
    assert prefetch_files == [False, True]  # the routes' file, the prefetch's


# --- forcing and skipping ----------------------------------------------------------------------


def test_static_and_forced_choices_time_nothing(choice_dir):
    runs, calls = counting({"native": 1.0, "widened": 2.0})
    static = choice.choose({"prompts": runs}, {"prompts": "widened"}, {"k": 5}, "static")
    forced = choice.choose({"prompts": runs}, {"prompts": "native"}, {"k": 5}, "prompts=widened")
    assert (static.how, static.picks, forced.how, forced.picks) == \
        ("static", {"prompts": "widened"}, "forced", {"prompts": "widened"})
    assert sum(calls.values()) == 0 and not list(choice_dir.iterdir())
    with pytest.raises(choice.ChoiceError, match="cannot run here: choose one of native, widened"):
        choice.choose({"prompts": runs}, {"prompts": "native"}, {"k": 5}, "prompts=integer")


def test_bad_options_are_one_clear_error(tiny_checkpoint):
    import bloom

    with pytest.raises(CpuPathError, match="bad CPU choice"):
        CpuOptions(choice="fastest")
    with pytest.raises(CpuPathError, match="unknown int8_activations"):
        CpuOptions(int8_activations="maybe")
    with pytest.raises(CpuPathError, match="cannot run here"):  # fp32 weights have no integer route
        Generator.from_pretrained(tiny_checkpoint, cpu=CpuOptions(choice="prompts=integer"))
    with pytest.raises(SystemExit) as exit_:
        bloom.main(["--weights", str(tiny_checkpoint), "--int8_activations=sometimes", "Hi"])
    assert exit_.value.code == 2


def test_the_cli_takes_off_on_auto_and_the_bare_flag(tiny_checkpoint, capsys):
    import bloom

    assert bloom.bare_flags_as_on(["--int8_activations", "Hi"]) == ["--int8_activations=on", "Hi"]
    assert bloom.bare_flags_as_on(["--int8_activations"]) == ["--int8_activations=on"]
    assert bloom.bare_flags_as_on(["--int8_activations", "off", "Hi"]) == ["--int8_activations", "off", "Hi"]
    lines = {}
    for mode in ("off", "on", "auto"):
        assert bloom.main(["--weights", str(tiny_checkpoint), "--quantize", "int8", "--int8_activations", mode,
                           "--max_length", "12", "Hi"]) == 0
        lines[mode] = next(line for line in capsys.readouterr().err.splitlines() if "CPU fast path" in line)
    assert "integer products" not in lines["off"] and "int8 integer products (" in lines["on"]
    assert "routes prompts" in lines["auto"]  # the route line says what was chosen, and how


# --- the accuracy contract ---------------------------------------------------------------------


def held_out_texts(checkpoint: Path) -> list[str]:
    from utils import kjv_corpus

    try:
        return kjv_corpus.load().held_out[:3]
    except Exception:
        return [(checkpoint / "README.md").read_text()]


def our_perplexity(generator: Generator, texts: list[str]) -> float:
    """exp of the mean negative log-prob of every token given those before it, through our own
    products (a scoring pass: the prompts' route)."""
    rows = [generator.tokenizer.encode(t)[:256] for t in texts]
    scores = score_rows(generator.runner, rows)
    logprobs = [lp for s in scores for lp in s.token_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


def hf_greedy(model, ids: list[int], new: int):
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=3)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    margins = [float(lp.topk(2).values[0] - lp.topk(2).values[1]) for lp in logprobs]
    return tokens, [lp[t].item() for lp, t in zip(logprobs, tokens)], margins


@pytest.fixture(scope="module")
def fp32_perplexity(tiny_checkpoint):
    return our_perplexity(Generator.from_pretrained(tiny_checkpoint, cpu=CpuOptions(choice="static")),
                          held_out_texts(tiny_checkpoint))


@pytest.fixture(scope="module")
def references(tiny_checkpoint, tmp_path_factory):
    """transformers on each mode's dequantized weights (the quantization is the same on every route)."""
    out = {}
    for mode in PERPLEXITY:
        model = Generator.from_pretrained(tiny_checkpoint, quantize=mode, int8_activations="off").model
        folder = write_dequantized(tiny_checkpoint, model, tmp_path_factory.mktemp(f"dequantized-{mode}"))
        out[mode] = transformers.BloomForCausalLM.from_pretrained(folder).eval()
    return out


def check_contract(generator: Generator, reference, mode: str, fp32: float, texts: list[str]) -> str:
    """Assert the contract for ``generator``; returns a line of what it measured."""
    got = our_perplexity(generator, texts)
    assert abs(got / fp32 - 1) <= PERPLEXITY[mode], f"perplexity {got:.3f} against fp32's {fp32:.3f}"
    compared = 0
    for prompt in PROMPTS:
        ids = generator.tokenizer.encode(prompt)
        result = generator.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)[0]
        tokens, logprobs, margins = hf_greedy(reference, ids, NEW_TOKENS)
        clear = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        assert result.token_ids[:clear] == tokens[:clear], prompt
        assert result.sequences[0].token_logprobs[:clear] == pytest.approx(logprobs[:clear], abs=LOGPROBS)
        compared += clear
    assert compared >= 2 * NEW_TOKENS  # the comparison is not empty
    return f"perplexity {got:.3f} ({got / fp32 - 1:+.2%} against fp32), {compared} greedy tokens compared"


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(PERPLEXITY))
@pytest.mark.parametrize("route", ["measure"] + FORCED)
def test_every_route_keeps_the_contract(tiny_checkpoint, references, fp32_perplexity, choice_dir, mode, route):
    generator = Generator.from_pretrained(tiny_checkpoint, quantize=mode, cpu=CpuOptions(choice=route))
    line = generator.backend.fast_path
    if route != "measure":
        picks = dict(pair.split("=") for pair in route.split(","))
        assert f"routes prompts {picks['prompts']}, decode {picks['decode']} (forced)" in line
    print(f"{mode} {route}: {check_contract(generator, references[mode], mode, fp32_perplexity, held_out_texts(tiny_checkpoint))}")


BF16_ROUTES = {None: ["measure", "prompts=native", "prompts=widened", "prompts=kernel"],
               "int8": ["measure", "prompts=native", "prompts=widened", "prompts=integer,decode=integer"],
               "int4": ["measure", "prompts=native", "prompts=widened", "prompts=integer,decode=integer"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode, route", [(m, r) for m, routes in BF16_ROUTES.items() for r in routes])
def test_bf16_routes_keep_the_contract(tiny_checkpoint, fp32_perplexity, choice_dir, mode, route):
    """bf16 on each route: the perplexity through our products within the mode's bound (1% for
    bf16 weights) plus 1% for bf16 activations, of fp32's. (bf16 weights are exact in fp32: the
    float routes differ only in where sums are rounded.)"""
    generator = Generator.from_pretrained(tiny_checkpoint, dtype="bf16", quantize=mode, cpu=CpuOptions(choice=route))
    if route == "prompts=kernel" and "kernels" not in generator.backend.fast_path:
        pytest.skip("no kernels here")
    got = our_perplexity(generator, held_out_texts(tiny_checkpoint))
    print(f"bf16 {mode} {route}: perplexity {got:.3f} ({got / fp32_perplexity - 1:+.2%})")
    assert abs(got / fp32_perplexity - 1) <= PERPLEXITY.get(mode, 0.0) + 0.01, generator.backend.fast_path


AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
CAPPED_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from bloom_hpu.runtime.cpu import CpuOptions
    from generation import Generator
    import test_cpu_choice as t
    import transformers
    from dequantized import write_dequantized
    from pathlib import Path
    checkpoint, out = Path(sys.argv[1]), Path(sys.argv[2])
    texts = t.held_out_texts(checkpoint)
    fp32 = t.our_perplexity(Generator.from_pretrained(checkpoint, cpu=CpuOptions(choice="static")), texts)
    for mode in t.PERPLEXITY:
        for route in ["measure"] + t.FORCED:
            g = Generator.from_pretrained(checkpoint, quantize=mode, cpu=CpuOptions(path="avx2", choice=route))
            folder = write_dequantized(checkpoint, g.model, out / f"{mode}-{len(route)}")
            reference = transformers.BloomForCausalLM.from_pretrained(folder).eval()
            print(mode, route, t.check_contract(g, reference, mode, fp32, texts), "|", g.backend.fast_path, flush=True)
""")


@pytest.mark.slow
def test_every_route_keeps_the_contract_on_the_avx2_build_capped(tiny_checkpoint, choice_dir, tmp_path):
    """The same contract as an AVX2-only CPU runs it: our AVX2 build, and torch, oneDNN and MKL
    capped at AVX2 (their caps are read at start-up: a process of its own)."""
    needs_isa("avx2")
    run = subprocess.run([sys.executable, "-c", CAPPED_RUN, str(tiny_checkpoint), str(tmp_path)], cwd=ROOT,
                         env={**os.environ, **AVX2_CAPS, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=1200)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("greedy tokens compared") == 2 * (1 + len(FORCED))
    assert "AVX2 kernels" in run.stdout


def test_each_route_runs_where_it_is_set(make_ckpt, choice_dir):
    """A product's route follows its input's shape (``prompt_shaped``): with integer products for
    prompts only, the integer kernel sees a prefill's [1, T, K] inputs and no decode step's; for
    decode rows only, a decode step's [1, 1, K] (and the prefill's LM head, one row a prompt) and
    no [1, T, K]; the one-call decode step takes the route the op-by-op step takes."""
    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    one_call = {}
    for route in ("prompts=integer,decode=weight-only", "prompts=native,decode=integer",
                  "prompts=native,decode=weight-only"):
        g = Generator.from_pretrained(folder, quantize="int8", cpu=CpuOptions(choice=route))
        seen = []
        for m in quantized_products(g.model):
            if m.block_kernel is not None:
                m.block_kernel = (lambda kernel: lambda x, *a: seen.append(tuple(x.shape)) or kernel(x, *a))(m.block_kernel)
        ids = torch.tensor([g.tokenizer.encode("The quick brown fox jumps over the lazy dog")])
        n = ids.shape[1]
        cache = g.model.allocate_cache(1, n + 8)
        with torch.no_grad():
            token = g.model.prefill(ids, torch.tensor([n]), cache).argmax(-1)[:, None]
            prefill_shapes, seen[:] = set(seen), []
            op_by_op = g.model.decode(token, torch.tensor([n]), cache, n + 1)
            plan = g.backend.cpu_plan
            one_call[route] = plan.decode(token, torch.tensor([n]), cache, n + 1) if plan.decode else op_by_op
        decode_shapes = set(seen)
        if route.startswith("prompts=integer"):
            assert prefill_shapes and all(s[1] == n for s in prefill_shapes if len(s) == 3) and not decode_shapes
        elif "decode=integer" in route:
            assert all(len(s) == 2 or s[1] == 1 for s in prefill_shapes) and decode_shapes == {(1, 1, 64), (1, 1, 256), (1, 64)}
        else:
            assert not prefill_shapes and not decode_shapes
        torch.testing.assert_close(one_call[route], op_by_op, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(one_call["prompts=native,decode=integer"], one_call["prompts=native,decode=weight-only"],
                              atol=1e-4)


# --- the weight prefetch ------------------------------------------------------------------------


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_the_weight_prefetch_is_timed_once_then_read(choice_dir, monkeypatch, isa):
    """The three prefetch kinds (none, L1, L2) are timed on a weight of the model's format streamed
    from memory (for float weights, once per row class, with its first row count; int8 and int4
    once, with one row), the fastest kept and set in the kernels for that format and class, then
    read from the cache, one file per format; static takes the vendor's rule for every row count,
    timing nothing; ``$BLOOM_CPU_PREFETCH`` forces one."""
    from bloom_hpu.runtime.cpu import prefetch
    from bloom_hpu.runtime.cpu.kernels import load
    from bloom_hpu.tp import Parallel

    kernels = load(isa)
    classes = list(kernels.prefetch_row_classes())
    assert classes[0] == 1 and classes == sorted(set(classes)) and len(classes) > 1
    monkeypatch.delenv(capability.PREFETCH_ENV, raising=False)
    monkeypatch.setattr(prefetch, "STREAM_BYTES", 8 << 20)  # the choice's machinery, not a figure
    products, rows_timed = [], []
    timed_products = prefetch.streamed_product

    def seen(kernels, weights, activations, huge_pages):  # the product timed is the format's own
        products.append(weights)
        product = timed_products(kernels, weights, activations, huge_pages)

        def call(rows):
            rows_timed.append((weights, rows))
            return product(rows)
        return call

    monkeypatch.setattr(prefetch, "streamed_product", seen)
    files = set()
    for n, (quantized, fmt) in enumerate([(None, 0), ("int8", 1), ("int4", 2)], start=1):
        weights = quantized or "bf16"
        kind, measured = prefetch.choose_prefetch(kernels, "measure", Parallel(), quantized=quantized)
        new = set(choice_dir.iterdir()) - files  # one file per format
        files |= new
        assert len(new) == 1 and products == ["bf16", "int8", "int4"][:n]
        own = classes if quantized is None else [1]
        assert sorted({rows for w, rows in rows_timed if w == weights}) == own
        times = json.loads(new.pop().read_text())["times"]
        assert sorted(times) == [f"prefetch:{rows}" for rows in own]
        fastest = {rows: min(times[f"prefetch:{rows}"], key=times[f"prefetch:{rows}"].get) for rows in own}
        assert all(sorted(times[f"prefetch:{rows}"]) == ["l1", "l2", "none"] for rows in own)
        assert kind == fastest[1] and measured == f"weight prefetch {prefetch.described(fastest)} (measured)"
        in_force = [kernels.prefetch_in_force(fmt, rows) for rows in range(1, 2 * classes[-1] + 1)]
        kept = fastest if quantized is None else {start: kind for start in classes}  # int: one kind for every count
        assert in_force == [capability.PREFETCH_KINDS[kept[max(start for start in classes if start <= rows)]]
                            for rows in range(1, 2 * classes[-1] + 1)]
        assert prefetch.choose_prefetch(kernels, "measure", Parallel(), quantized=quantized) == \
            (kind, measured.replace("measured", "cached"))
    monkeypatch.setattr(capability, "cpu_vendor", lambda: "AuthenticAMD")
    assert prefetch.choose_prefetch(kernels, "static", Parallel()) == ("l2", "weight prefetch l2 (by vendor)")
    monkeypatch.setattr(capability, "cpu_vendor", lambda: "GenuineIntel")
    assert prefetch.choose_prefetch(kernels, "prompts=native", Parallel()) == ("l1", "weight prefetch l1 (by vendor)")
    monkeypatch.setenv(capability.PREFETCH_ENV, "l2")
    assert prefetch.choose_prefetch(kernels, "measure", Parallel()) == ("l2", "weight prefetch l2 (forced)")
    assert len(list(choice_dir.iterdir())) == 3 and len(products) == 3  # nothing more timed
    monkeypatch.delenv(capability.PREFETCH_ENV)
    for quantized in (None, "int8", "int4"):  # the process's defaults again
        prefetch.choose_prefetch(kernels, "static", Parallel(), quantized=quantized)


def test_the_prefetch_line_names_each_row_count_from_which_another_kind_holds():
    from bloom_hpu.runtime.cpu.prefetch import described

    assert described({1: "none"}) == "none"
    assert described({1: "l2", 2: "l2", 4: "l2", 8: "l2"}) == "l2"
    assert described({1: "none", 2: "l2", 4: "l2", 8: "l2"}) == "none, l2 from 2 rows"
    assert described({1: "none", 2: "none", 4: "l2", 8: "l1"}) == "none, l2 from 4 rows, l1 from 8 rows"


# --- the rows integer products take in place -------------------------------------------------


def test_the_rows_in_place_make_the_least_summed_time():
    """The limit whose times (counts up to it in place, the rest through the panel) add up to the
    least: one count timed slow does not end the in-place counts early; without times (static,
    forced), the counts up to the first the panel was picked for."""
    from bloom_hpu.runtime.cpu.integer_rows import rows_in_place

    def timed(in_place, panel):
        times = {f"rows:{m}": {"in place": a, "panel": b} for m, a, b in zip((5, 6, 7, 8), in_place, panel)}
        picks = {k: min(t, key=t.get) for k, t in times.items()}
        return choice.Chosen(picks, "measured", times)

    assert rows_in_place(timed([3, 3, 3, 4], [4, 4, 4, 5]), 4) == 8
    assert rows_in_place(timed([7, 7, 8, 10], [8, 9, 11, 9]), 4) == 7
    assert rows_in_place(timed([10, 7, 8, 10], [8, 9, 11, 9]), 4) == 7  # 5 rows timed slow in place
    assert rows_in_place(timed([9, 9, 9, 9], [8, 8, 8, 8]), 4) == 4
    picks = {"rows:5": "in place", "rows:6": "panel", "rows:7": "in place", "rows:8": "in place"}
    assert rows_in_place(choice.Chosen(picks, "forced", {}), 4) == 5


@pytest.mark.parametrize("quantized", ["int8", "int4"])
def test_the_rows_in_place_are_timed_once_then_read(choice_dir, monkeypatch, quantized):
    """Both paths timed at 5-8 rows over a weight of the format (with the prefetch in force), the
    limit set in the kernels for that format and said, then read from the cache; static keeps the
    build's default, timing nothing; another prefetch kind is another answer; the AVX2 build has
    nothing to choose."""
    from bloom_hpu.runtime.cpu import integer_rows, prefetch
    from bloom_hpu.runtime.cpu.kernels import load
    from bloom_hpu.tp import Parallel

    needs_isa("avx512_bf16")
    kernels = load("avx512_bf16")
    monkeypatch.setattr(prefetch, "STREAM_BYTES", 8 << 20)  # the choice's machinery, not a figure
    fmt = capability.PREFETCH_FORMATS[quantized]
    calls, limits = [], []
    product, set_rows = kernels.block_q8_linear, kernels.set_q8_few_rows
    spied = dataclasses.replace(
        kernels, block_q8_linear=lambda x, q, s, b: (calls.append((x.shape[0], q.dtype)), product(x, q, s, b))[1],
        set_q8_few_rows=lambda rows, f: (limits.append((rows, f)), set_rows(rows, f))[1])
    choose = integer_rows.choose_integer_rows  # the build's default comes back after the test (conftest)
    line = choose(spied, "measure", Parallel(), quantized, torch.bfloat16, False, "l1")
    assert line.startswith("integer products in place up to ") and line.endswith(" rows (measured)")
    rows = int(line.split()[6])
    assert 4 <= rows <= 8 and limits[-1] == (rows, fmt)
    weight_dtype = torch.int8 if quantized == "int8" else torch.uint8
    assert {m for m, _ in calls} == {5, 6, 7, 8} and {d for _, d in calls} == {weight_dtype}
    (file,) = choice_dir.iterdir()
    content = json.loads(file.read_text())
    assert sorted(content["times"]) == ["rows:5", "rows:6", "rows:7", "rows:8"]
    assert content["times"]["rows:5"].keys() == {"in place", "panel"}
    timed = len(calls)
    assert choose(spied, "measure", Parallel(), quantized, torch.bfloat16, False, "l1") == \
        line.replace("measured", "cached")
    one_pass, default, most = kernels.q8_few_rows_bounds()  # csrc/block_q8.h's counts on this build
    assert (one_pass, most) == (4, 8) and one_pass <= default <= most
    for option in ("static", "prompts=native"):  # another key forced: the default too
        assert choose(spied, option, Parallel(), quantized, torch.bfloat16, False, "l1") == \
            f"integer products in place up to {default} rows (by default)"
    assert len(calls) == timed and limits[-1] == (default, fmt)  # nothing more timed; the default set
    assert choose(spied, "measure", Parallel(), quantized, torch.bfloat16, False, "l2").endswith("(measured)")
    assert len(calls) > timed and len(list(choice_dir.iterdir())) == 2  # another prefetch: timed again
    one_pass_only = dataclasses.replace(kernels, q8_few_rows_bounds=lambda: [4, 4, 4])  # as the AVX2 build
    assert choose(one_pass_only, "measure", Parallel(), quantized, torch.bfloat16, False, "l1") is None
