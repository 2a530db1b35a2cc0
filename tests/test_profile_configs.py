"""utils/profile_configs.py: the sweep, the latency filter, the memory skip, resume, the spec file,
the outputs, a two-rank configuration under the DeepSpeed launcher, and bad input.

The end-to-end runs use a tiny shape (2 layers, 64 hidden, 4 heads, vocabulary 1024: the test
checkpoints' shape) and one timed round, so the figures are noise; what is checked is what the
profiler does with them."""

from __future__ import annotations

import csv
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils import profile_configs
from utils.profiling.memory import memory_need
from utils.profiling.random_model import RandomReader
from utils.profiling.report import judge, pareto_front
from utils.profiling.spec import load_spec
from utils.profiling.sweep import product

ROOT = Path(__file__).resolve().parent.parent
TINY = {"n_layer": 2, "hidden_size": 64, "n_head": 4, "vocab_size": 1024}
HUGE_BATCH = 10**7  # its KV cache alone is ~120 GB: skipped on any machine that runs these tests


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "utils" / "profile_configs.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def read_csv(folder: Path) -> list[dict]:
    with (folder / "results.csv").open() as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------- one sweep, end to end


SWEEP = dict(tp=[1], dtypes=["fp32", "bf16"], batches=[2, HUGE_BATCH], lengths=["8,4"], scenario="both")


def sweep_args(spec: Path, out: Path, *extra) -> list:
    return ["--model", spec, "--tensor_parallel_sizes", *SWEEP["tp"], "--dtypes", *SWEEP["dtypes"],
            "--max_batch_sizes", *SWEEP["batches"], "--input_output_lengths", *SWEEP["lengths"],
            "--scenario", SWEEP["scenario"], "--repeats", "1", "--threads", "2", "--out", out, *extra]


@pytest.fixture(scope="module")
def sweep(tiny_spec, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    done = run_cli(*sweep_args(tiny_spec, out, "--max_latency_ms", "100000"))
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


def expected_keys() -> set[str]:
    keys = set()
    for tp, dtype, scenario, batch, io in itertools.product(SWEEP["tp"], SWEEP["dtypes"], ("offline", "online"),
                                                            SWEEP["batches"], SWEEP["lengths"]):
        n_in, n_out = io.split(",")
        keys.add(f"{scenario} tp{tp} {dtype} batch{batch} in{n_in} out{n_out}")
    return keys


@pytest.mark.slow
def test_every_configuration_of_the_product_has_one_row(sweep):
    out, _ = sweep
    rows = read_csv(out)
    assert len(rows) == 2 * 2 * 2 == len(expected_keys())
    assert {r["key"] for r in rows} == expected_keys()


def test_a_configuration_too_big_for_memory_is_skipped_with_its_figure(sweep):
    out, _ = sweep
    rows = {r["key"]: r for r in read_csv(out)}
    for key, row in rows.items():
        if f"batch{HUGE_BATCH} " in key:
            assert row["status"] == "skipped", row
            assert "needs" in row["why"] and "free" in row["why"]
            # Keys and values of every layer for 10^7 rows of 12 tokens in fp32/bf16, at the least.
            element = 4 if " fp32 " in key else 2
            assert float(row["need_gib"]) * 2**30 >= 2 * 2 * HUGE_BATCH * 12 * 64 * element
            assert row["tokens_per_s"] == ""
        else:
            assert row["status"] == "ok", row
            # ms/token: (full - TTFT) / 3 tokens, 0 where one noisy round of a tiny model made it negative
            assert float(row["tokens_per_s"]) > 0 and float(row["latency_ms"]) >= 0


def test_online_rows_come_from_the_client_levels(sweep):
    out, _ = sweep
    document = json.loads((out / "results.json").read_text())
    online = [r for r in document["records"] if r["scenario"] == "online" and r["status"] == "measured"]
    assert len(online) == 2
    for record in online:
        assert [level["clients"] for level in record["levels"]] == [1, 2]
        for level in record["levels"]:
            assert level["requests"] >= 4 and level["tokens"] == 4 * level["requests"]  # ignore_eos: all 4
            assert level["ttft_p50"] <= level["ttft_p99"] and level["itl_p50"] <= level["itl_p99"]


def test_the_best_is_the_fastest_within_the_bound_and_printed_first(sweep):
    out, done = sweep
    assert "estimate: about" in done.stderr and "left)" in done.stderr
    rows = read_csv(out)
    ok = [r for r in rows if r["status"] == "ok"]
    fastest = max(ok, key=lambda r: float(r["tokens_per_s"]))
    assert rows[0]["key"] == fastest["key"]
    table = done.stdout.splitlines()
    assert "tok/s" in table[0]
    assert fastest["key"] in table[2] and table[2].rstrip().endswith("best")
    assert json.loads((out / "results.json").read_text())["best"] == fastest["key"]


def test_results_json_says_what_ran_where(sweep, tiny_spec):
    out, _ = sweep
    document = json.loads((out / "results.json").read_text())
    assert document["model"]["n_layer"] == 2 and document["model"]["hidden_size"] == 64
    assert document["versions"]["torch"] == torch.__version__.split("+")[0] or document["versions"]["torch"]
    assert document["machine"]["cpu"] and document["machine"]["cores"] >= 1
    assert "--max_batch_sizes" in document["command"] and str(tiny_spec) in document["command"]
    assert len(document["configurations"]) == len(expected_keys())


def test_the_picture_has_a_point_per_measured_configuration(sweep):
    from PIL import Image

    out, _ = sweep
    document = json.loads((out / "results.json").read_text())
    measured = {r["key"]: r for r in read_csv(out) if r["latency_ms"]}
    points = document["plot"]["points"]
    assert {p["key"] for p in points} == set(measured) and len(points) == 4
    for p in points:
        assert math.isclose(p["latency_ms"], float(measured[p["key"]]["latency_ms"]), rel_tol=1e-9)
        assert math.isclose(p["tokens_per_s"], float(measured[p["key"]]["tokens_per_s"]), rel_tol=1e-9)
    assert document["plot"]["pareto"] and set(document["plot"]["pareto"]) <= set(measured)
    assert document["plot"]["bound_ms"] == 100000
    with Image.open(out / "profile.png") as image:
        assert image.format == "PNG" and image.size[0] >= 600
        # Not a blank canvas: the points, lines and text make many colours.
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 20


def test_a_rerun_skips_what_is_done_and_applies_a_new_bound(sweep, tiny_spec, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(sweep[0], out)
    done = run_cli(*sweep_args(tiny_spec, out, "--max_latency_ms", "0.001"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 to measure" in done.stderr and "drawing random" not in done.stderr
    rows = read_csv(out)
    measured = [r for r in rows if r["latency_ms"]]
    rejected = {r["scenario"] for r in measured if r["status"] == "rejected"}
    timed = any(float(r["latency_ms"]) > 0.001 for r in measured if r["scenario"] == "offline")
    assert "online" in rejected and ("offline" in rejected) == timed
    for r in measured:
        # (one noisy round of a tiny model can make an offline decode time 0: within any bound)
        assert (r["status"] == "rejected") == (float(r["latency_ms"]) > 0.001), r
        if r["status"] == "rejected":
            assert "> 0.001 ms" in r["why"] and ("decode" in r["why"]) == (r["scenario"] == "offline")
    assert rows[0]["status"] == "ok" or "best" not in done.stdout


@pytest.mark.slow
def test_a_partial_run_measures_only_the_rest(sweep, tiny_spec, tmp_path):
    out = tmp_path / "partial"
    shutil.copytree(sweep[0], out)
    document = json.loads((out / "results.json").read_text())
    dropped = "offline tp1 bf16 batch2 in8 out4"
    document["records"] = [r for r in document["records"] if r["key"] != dropped]
    (out / "results.json").write_text(json.dumps(document))
    done = run_cli(*sweep_args(tiny_spec, out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 to measure" in done.stderr
    assert done.stderr.count("[profile] measuring") == 1 and f"measuring {dropped}" in done.stderr
    assert {r["key"] for r in read_csv(out)} == expected_keys()


def test_weights_too_big_skip_every_configuration_without_drawing_them(tmp_path):
    spec = tmp_path / "huge.yaml"
    spec.write_text("n_layer: 4\nhidden_size: 40960\nn_head: 32\nvocab_size: 1024\n")  # ~80 G weights
    done = run_cli("--model", spec, "--dtypes", "fp32", "int8", "--out", tmp_path / "out", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "drawing random" not in done.stderr
    rows = read_csv(tmp_path / "out")
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    fp32 = next(r for r in rows if r["dtype"] == "fp32")
    assert float(fp32["need_gib"]) * 2**30 >= 4 * 12 * 40960**2 * 4  # 4 layers of 12 h^2 fp32 weights


# --------------------------------------------------------------------------- the pieces


def test_the_product_has_every_combination_once():
    configs = product("both", [1, 2], ["fp32", "int8"], [1, 4, 16], [(60, 20), (200, 200)])
    assert len(configs) == 2 * 2 * 2 * 3 * 2 == len({c.key for c in configs})
    assert [c.tp for c in configs] == sorted(c.tp for c in configs)  # one launch per size
    assert product("offline", [1, 1], ["bf16"], [4, 4], [(8, 4)]) == product("offline", [1], ["bf16"], [4], [(8, 4)])


def test_speculation_is_an_axis_of_the_offline_configurations():
    configs = product("both", [1], ["bf16"], [1, 4], [(8, 4)], ["off", "ngram:4"])
    offline = [c for c in configs if c.scenario == "offline"]
    assert len(offline) == 2 * 2 and {c.speculate for c in offline} == {"off", "ngram:4"}
    assert {c.speculate for c in configs if c.scenario == "online"} == {"off"}  # serve_bench's engine: none
    assert len({c.key for c in configs}) == len(configs)
    # Without speculation a key is what earlier runs wrote (a rerun finds them done).
    assert "offline tp1 bf16 batch4 in8 out4" in {c.key for c in configs}


def test_adaptive_rounds_stop_on_time_spent_or_agreement_and_every_rank_agrees():
    from bench.generate_bench import Rounds

    assert [Rounds(3).done({"ours": [1.0] * n}) for n in range(4)] == [False, False, False, True]
    adaptive = Rounds(3, min_repeats=1, min_timed_s=10.0, spread=0.05)
    assert not adaptive.done({"ours": []})
    assert adaptive.done({"ours": [12.0]})  # one long request: enough
    assert not adaptive.done({"ours": [1.0]})
    assert not adaptive.done({"ours": [1.0, 1.2]})  # 20% apart, 2.2 s: one more
    assert adaptive.done({"ours": [1.0, 1.04]})  # within 5%
    assert adaptive.done({"ours": [1.0, 2.0, 3.0]})  # the most
    # Another rank that would go on (agree: False) keeps this one going too.
    assert not Rounds(3, min_repeats=1, min_timed_s=10.0, agree=lambda stop: False).done({"ours": [12.0]})


def test_time_variants_warms_up_with_a_decode_step_and_times_adaptive_rounds():
    from bench.generate_bench import Rounds, Variant, time_variants

    asked = []
    variant = Variant("ours", lambda n: asked.append(n))
    ttft, full = time_variants([variant], warmup=1, repeats=Rounds(3, min_repeats=2, min_timed_s=1e9, spread=1e9),
                               new_tokens=50, device=torch.device("cpu"), warmup_tokens=2)
    assert asked == [2, 1, 50, 1, 50]  # warm-up: the prompt and one decode step; then 2 rounds (agreeing)
    assert len(ttft["ours"]) == len(full["ours"]) == 2
    asked.clear()
    time_variants([variant], warmup=1, repeats=2, new_tokens=50, device=torch.device("cpu"))
    assert asked == [1, 50, 1, 50, 1, 50]  # generate_bench's own way, unchanged


def test_the_estimate_grows_with_the_work_and_counts_the_rounds():
    from utils.profiling.estimate import config_seconds, rounds_of, sweep_seconds

    spec = load_spec("bloom-560m").shape()
    plan = {"repeats": 3, "min_repeats": 1, "min_timed_s": 10.0, "warmup": 1, "requests_per_client": 2}
    rates = {"read_bytes_s": 10e9, "ops_s": {"float32": 100e9, "bfloat16": 200e9}}

    def seconds(**config):
        base = {"key": "k", "scenario": "offline", "tp": 1, "dtype": "bf16", "max_batch": 1, "input_len": 60,
                "output_len": 20}
        return config_seconds(spec, {**base, **config}, plan, rates, shared=True)

    assert seconds(max_batch=16) > seconds(max_batch=4) > seconds()
    assert seconds(input_len=200, output_len=200) > seconds()
    assert seconds(dtype="fp32") > seconds(dtype="bf16")
    # A decode step of bloom-560m in bf16 at batch 1 reads ~1.1 GB: ~0.11 s at 10 GB/s; 19 of them.
    assert 19 * 0.11 < seconds() < 3 * 19 * 0.2 + 5
    assert [rounds_of(s, plan) for s in (0.5, 4.0, 12.0)] == [3, 3, 1]
    configs = [{"key": f"k{b}", "scenario": "offline", "tp": 1, "dtype": "bf16", "max_batch": b, "input_len": 60,
                "output_len": 20} for b in (1, 4)]
    total = sweep_seconds(spec, configs, plan, rates, shared=True)
    assert total["total"] == pytest.approx(total["startup"] + sum(total["configs"].values()))
    assert total["startup"] > 1.1e9 / 1e9  # the bf16 weights' pages at least


def offline_record(decode_ms: float, tokens_per_s: float) -> dict:
    return {"key": "k", "scenario": "offline", "tp": 2, "dtype": "bf16", "max_batch": 4, "input_len": 8,
            "output_len": 4, "status": "measured",
            "offline": {"ttft_ms": 5.0, "decode_ms_per_token": decode_ms, "tokens_per_s": tokens_per_s,
                        "batch_s": 0.5, "runs_ms": [500.0]}}


def level(clients: int, tok_s: float, itl_p99: float, ttft_p99: float) -> dict:
    return {"clients": clients, "tok_s": tok_s, "req_s": tok_s / 4, "ttft_p50": ttft_p99 / 2, "ttft_p99": ttft_p99,
            "itl_p50": itl_p99 / 2, "itl_p99": itl_p99}


def test_offline_bound_is_on_the_decode_time_per_token():
    assert judge(offline_record(40.0, 100.0), 50)["status"] == "ok"
    rejected = judge(offline_record(60.0, 100.0), 50)
    assert rejected["status"] == "rejected" and rejected["why"] == "decode 60.0 ms/token > 50 ms"
    assert judge(offline_record(60.0, 100.0), None)["status"] == "ok"
    assert judge(offline_record(40.0, 100.0), 50)["tokens_per_s_per_card"] == 50.0


def test_speculation_has_its_columns_and_older_records_read_as_without():
    from utils.profiling.report import csv_text

    record = offline_record(40.0, 100.0)
    speculating = {**record, "key": "k ngram:4", "speculate": "ngram:4", "wall_s": 12.5,
                   "offline": {**record["offline"], "acceptance": 0.25}}
    rows = list(csv.DictReader(csv_text([judge(speculating, 50), judge(record, 50)]).splitlines()))
    assert (rows[0]["speculate"], rows[0]["acceptance"], rows[0]["wall_s"]) == ("ngram:4", "0.25", "12.5")
    assert (rows[1]["speculate"], rows[1]["acceptance"]) == ("off", "")  # a record of an earlier run


def test_online_takes_the_fastest_level_within_the_bound_on_inter_token_and_first_token():
    record = {**offline_record(0, 0), "scenario": "online",
              "levels": [level(1, 50, 20, 30), level(2, 90, 40, 45), level(4, 150, 45, 80)]}
    row = judge(record, 50)  # level 4's first token is over the bound
    assert (row["status"], row["clients"], row["tokens_per_s"]) == ("ok", 2, 90)
    row = judge(record, 10)
    assert row["status"] == "rejected" and row["clients"] == 1
    assert row["why"] == "ITL p99 20.0 ms and TTFT p99 30.0 ms > 10 ms even at 1 client(s)"
    assert judge(record, None)["clients"] == 4


def test_pareto_front():
    rows = [{"latency_ms": 10, "tokens_per_s": 100}, {"latency_ms": 20, "tokens_per_s": 300},
            {"latency_ms": 30, "tokens_per_s": 200}, {"latency_ms": 5, "tokens_per_s": 50}]
    assert pareto_front(rows) == [rows[0], rows[1], rows[3]]


def test_memory_need_of_bloom_560m():
    spec = load_spec("bloom-560m").shape()
    one = {"input_len": 60, "output_len": 20, "max_batch": 1}
    # bloom-560m has 559,214,592 parameters (its model card).
    assert memory_need(spec, "fp32", one, 1, 0).weights == 559_214_592 * 4
    assert memory_need(spec, "bf16", one, 2, 0).weights == pytest.approx(559_214_592, rel=0.01)
    assert memory_need(spec, "int8", one, 1, 0).weights < 0.3 * 559_214_592 * 4 + 2**20


def test_spec_files_json_yaml_and_config_json_agree(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(TINY))
    (tmp_path / "b.yml").write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "n_embed": 64,
                                                      "num_attention_heads": 4, "vocab_size": 1024}))
    shapes = [load_spec(str(tmp_path / name)).shape() for name in ("a.json", "b.yml", "config.json")]
    assert {k: shapes[0][k] for k in TINY} == TINY
    assert shapes[0] | {"name": ""} == shapes[1] | {"name": ""} == shapes[2] | {"name": ""}
    assert load_spec("bloom-7b1").shape()["n_head"] == 32


def test_random_weights_follow_the_recipe_and_every_rank_sees_the_same():
    spec = load_spec("bloom-560m")
    config = spec.config()
    with RandomReader(config, live_vocab=1000, seed=0) as reader:
        embeddings = reader.get("word_embeddings.weight", rows=slice(0, 4096))
        assert embeddings.shape == (4096, 1024)
        assert embeddings[:1000].std().item() == pytest.approx(10 / math.sqrt(1024), rel=0.02)
        assert embeddings[1000:].abs().max().item() == 0  # padded vocabulary
        assert reader.get("word_embeddings_layernorm.weight").mean().item() == pytest.approx(-1, abs=0.02)
        qkv = "h.3.self_attention.query_key_value.weight"
        whole = reader.get(qkv)
        assert whole.std().item() == pytest.approx(1 / math.sqrt(1024), rel=0.02)
        # A rank's rows or columns are the same numbers as those of the whole tensor.
        assert torch.equal(reader.get(qkv, rows=slice(1536, 3072)), whole[1536:3072])
        dense = "h.0.mlp.dense_4h_to_h.weight"
        assert torch.equal(reader.get(dense, cols=slice(2048, 4096)), reader.get(dense)[:, 2048:4096])
        assert reader.get(dense, dtype=torch.bfloat16).dtype == torch.bfloat16
    with RandomReader(config, live_vocab=1000, seed=1) as other:
        assert not torch.equal(other.get(qkv), whole)


def top_probabilities(transformer_weights: dict, checkpoint_config: Path, prompts: torch.Tensor) -> torch.Tensor:
    """transformers' BloomForCausalLM on ``transformer_weights`` (the normalized names): the
    probability of the top next token after each prompt [n]."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.BloomForCausalLM(transformers.BloomConfig.from_pretrained(checkpoint_config)).eval()
    model.transformer.load_state_dict(transformer_weights)
    model.tie_weights()
    with torch.no_grad():
        return model(prompts).logits[:, -1].float().softmax(-1).max(-1).values


def test_weights_cut_from_a_tiny_pool_are_still_the_recipes_kind(make_ckpt, monkeypatch):
    """The fast path cuts every block from one pool. Made as bad as it gets here (the pool one block
    long, so every block of every tensor is the same window; blocks of 16 rows of 256), the weights
    must still be a random model of the recipe: no two rows alike (the per-column signs), the
    recipe's statistics, and transformers' logits as peaky as on random_checkpoint's weights."""
    from bloom_hpu.checkpoint import expected_names
    from utils.profiling import random_model
    from utils.random_checkpoint import recipe_std

    monkeypatch.setattr(random_model, "BLOCK_ELEMENTS", 16 * 256)
    reference = make_ckpt(hidden_size=256, n_layer=2, n_head=4, seed=3)
    config = load_spec(str(reference / "config.json")).config()
    with RandomReader(config, live_vocab=1000, seed=0, pool_elements=1) as reader:
        assert reader._pools[torch.float32].numel() == 16 * 256  # one block: 16 rows of 256 or 4 of 1024
        weights = {name: reader.get(name) for name in expected_names(config)}

    rows = torch.cat([w[:1000] if name == "word_embeddings.weight" else w for name, w in weights.items()
                      if w.dim() == 2 and w.shape[1] == 256])
    unit = rows / rows.norm(dim=1, keepdim=True)
    cosines = (unit @ unit.T).fill_diagonal_(0).abs()
    # Two independent rows of 256: |cos| ~ 0.06; a row and its copy with random signs, ~0.11; equal rows, 1.
    assert cosines.max().item() < 0.8, "two rows of the weights are (nearly) the same"
    for name, w in weights.items():
        within = 4 / math.sqrt(2 * w.numel()) + 0.02  # four standard errors of a std estimate, relative
        if name.endswith("layernorm.weight") or name == "ln_f.weight":
            expected_mean = -1 if name.startswith("word_embeddings") else 1
            assert w.mean().item() == pytest.approx(expected_mean, abs=0.05), name
        elif name == "word_embeddings.weight":
            assert w[1000:].abs().max().item() == 0
            assert w[:1000].std().item() == pytest.approx(recipe_std(name, config, 10.0), rel=within)
        else:
            assert w.std().item() == pytest.approx(recipe_std(name, config, 10.0), rel=within), name

    from safetensors.torch import load_file

    prompts = torch.randint(0, 1000, (40, 12), generator=torch.Generator().manual_seed(0))
    ours = top_probabilities(weights, reference / "config.json", prompts)
    theirs = top_probabilities(load_file(reference / "model.safetensors"), reference / "config.json", prompts)
    # Peaky as random_checkpoint's (about 0.9 on the top token), and the top depends on the prompt.
    assert ours.median().item() > 0.6
    assert ours.median().item() == pytest.approx(theirs.median().item(), abs=0.15)


@pytest.mark.slow
def test_the_choice_confirmed_by_generate_bench(tmp_path):
    """The by-hand check of docs/profiling.md: the command the profiler prints for its best
    configuration, run, gives the same figures within this machine's noise (the embedded checkpoint's
    shape; generate_bench on its real weights, the profiler on random ones of the recipe)."""
    import shlex

    tiny = ROOT / "checkpoints" / "bloom-tiny"
    done = run_cli("--model", tiny, "--dtypes", "fp32", "--max_batch_sizes", "4", "--input_output_lengths", "32,64",
                   "--repeats", "5", "--min_repeats", "5", "--threads", "2", "--out", tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stderr.splitlines() if line.startswith("confirm the best by hand"))
    command = shlex.split(line.split(": ", 1)[1])
    assert command[:2] == ["python", "bench/generate_bench.py"] and str(tiny) in command
    figures = tmp_path / "bench.json"
    bench = subprocess.run([sys.executable, *command[1:], "--repeats", "5", "--json", figures], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(figures.read_text())
    theirs = next(r for r in result["rows"] if r["variant"] == "ours")
    ours = read_csv(tmp_path / "profile")[0]
    # The same configuration, exactly: the command carries the best row's shape and dtype.
    settings = result["settings"]
    assert (settings["batch_size"], settings["prompt_len"], settings["new_tokens"], settings["dtype"], settings["threads"]) \
        == (int(ours["max_batch"]), int(ours["input_len"]), int(ours["output_len"]), ours["dtype"], 2)
    # The same timing within a loaded machine's noise (two processes one after the other, on a
    # checkpoint whose decode takes 0.3 ms a token: 1.7x apart in one CI run), on the whole run's
    # tokens/s: a timing that left out the batch of 4 would be 4x off. Not the decode time per
    # token: at this size it is a difference of two noisy totals.
    ratio = float(ours["tokens_per_s"]) / theirs["tokens_per_s"]
    assert 0.4 < ratio < 2.5, (ours["tokens_per_s"], theirs["tokens_per_s"])


# --------------------------------------------------------------------------- two ranks


@pytest.mark.slow
def test_two_ranks_under_the_deepspeed_launcher(tiny_spec, tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "tp2"
    done = run_cli("--model", tiny_spec, "--tensor_parallel_sizes", "2", "--dtypes", "bf16", "--max_batch_sizes", "2",
                   "--input_output_lengths", "8,4", "--scenario", "both", "--repeats", "3", "--min_timed_s", "0.3",
                   "--threads", "2", "--out", out)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "deepspeed" in done.stderr.lower() or "[rank 1]" in done.stderr
    rows = {r["key"]: r for r in read_csv(out)}
    assert set(rows) == {"offline tp2 bf16 batch2 in8 out4", "online tp2 bf16 batch2 in8 out4"}
    for row in rows.values():
        assert row["status"] == "ok" and float(row["tokens_per_s"]) > 0
        assert float(row["tokens_per_s_per_card"]) == pytest.approx(float(row["tokens_per_s"]) / 2)
    records = json.loads((out / "results.json").read_text())["records"]
    # Adaptive rounds: the ranks agreed on a count (a disagreement would hang the launch), 1 to 3.
    offline = next(r for r in records if r["scenario"] == "offline")
    assert 1 <= len(offline["offline"]["runs_ms"]) == len(offline["offline"]["ttft_runs_ms"]) <= 3
    online = next(r for r in records if r["scenario"] == "online")
    assert all(level["tokens"] == 4 * level["requests"] for level in online["levels"])


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, message", [
    (["--model", "bloom-9b"], "unknown model 'bloom-9b'"),
    (["--model", "{spec}", "--tensor_parallel_sizes", "3"], "4 attention heads do not divide into 3"),
    (["--model", "{short}", "--input_output_lengths", "60,20"], "past the model's maximum length 64"),
    (["--model", "{spec}", "--dtypes"], "the sweep is empty: --dtypes has no values"),
    (["--model", "{spec}", "--input_output_lengths", "60"], "INPUT,OUTPUT pairs"),
    (["--model", "{spec}", "--dtypes", "fp8"], "unknown dtype 'fp8'"),
    (["--model", "{spec}", "--dtypes", "int4", "--tensor_parallel_sizes", "2"], "64 / 2 ranks is not a multiple"),
    (["--model", "{spec}", "--out", "{file}/sub"], "cannot write there"),
    (["--model", "{spec}", "--speculate", "ngram:99"], "--speculate: speculation 'ngram:99': K must be"),
    (["--model", "{spec}", "--speculate", "draft"], "a draft model is another model to profile"),
    (["--model", "{spec}", "--min_repeats", "4"], "--min_repeats must be from 1 to --repeats"),
])
def test_bad_input_is_one_error_line(args, message, tiny_spec, tmp_path, capsys):
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**TINY, "max_length": 64}))
    (tmp_path / "file").write_text("")
    args = [a.format(spec=tiny_spec, short=short, file=tmp_path / "file") for a in args]
    assert profile_configs.main([*args, "--out", str(tmp_path / "out")] if "--out" not in args else args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    done = run_cli("--model", "bloom-9b", "--out", tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("error: unknown model") and "Traceback" not in done.stderr
