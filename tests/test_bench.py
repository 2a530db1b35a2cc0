"""Smoke test of bench/generate_bench.py on the tiny checkpoint: it runs, prints one table, and its
JSON figures exist and agree with each other. No timing assertions: timings are the benchmark's job."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from bench import generate_bench


@pytest.fixture(scope="module")
def bench_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--config", "tiny", "--batch_size", "2", "--prompt_len", "4", "--new_tokens", "4", "--max_length", "16",
            "--repeats", "2", "--warmup", "1", "--bandwidth_mb", "32",
            "--variants", "ours,static off,graphs off,transformers", "--json", str(out)]
    return argv, out


def test_bench_prints_a_table_and_consistent_json(bench_output, capsys):
    argv, out = bench_output
    assert generate_bench.main(argv) == 0
    printed = capsys.readouterr().out
    for column in ("TTFT ms", "decode ms/tok", "tok/s", "peak MB", "graphs", "x floor", "decode/HF"):
        assert column in printed
    result = json.loads(out.read_text())
    assert result["settings"]["batch_size"] == 2 and result["machine"]["device"] == "cpu"
    assert result["shapes"] == {"prompt_len": 16, "cache_len": 16, "windows": [16]}  # static: max_length
    floor = result["floor"]
    assert floor["bandwidth_gb_s"] > 0
    # Measured in every timed round (2 here), the median kept.
    assert len(floor["bandwidth_per_round_gb_s"]) == 2
    assert floor["bandwidth_gb_s"] == pytest.approx(statistics.median(floor["bandwidth_per_round_gb_s"]), rel=1e-2)
    assert floor["floor_ms"] == pytest.approx(floor["bytes_per_decode_step"] / (floor["bandwidth_gb_s"] * 1e9) * 1e3)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["ours", "static off", "graphs off", "transformers"]
    hf = rows["transformers"]
    for name, row in rows.items():
        assert row["ttft_ms"] > 0 and row["decode_ms_per_token"] >= 0 and row["peak_mb"] is not None
        assert len(row["runs_ms"]) == 2
        # tokens/s is the returned tokens over the median full-request time.
        assert row["tokens_per_s"] == pytest.approx(2 * 4 / (statistics.median(row["runs_ms"]) / 1e3), rel=1e-2)
        assert row["x_floor"] == pytest.approx(row["decode_ms_per_token"] / floor["floor_ms"])
        if name != "transformers":
            assert row["ttft_vs_hf"] == pytest.approx(row["ttft_ms"] / hf["ttft_ms"])
            assert row["tokens_per_s_vs_hf"] == pytest.approx(row["tokens_per_s"] / hf["tokens_per_s"])
    # Static shapes: one prefill and one decode shape for the 1-token and the 4-token requests.
    assert rows["ours"]["graphs"] == 2
    assert rows["static off"]["graphs"] > 2  # dynamic shapes: the decode window grows every step
    # The KV cache of the static recipe: layers x 2 x rows x heads x max_length x head_dim x 4 bytes.
    m = result["model"]
    head_dim = m["hidden_size"] // m["n_head"]
    assert rows["ours"]["cache_mb"] * 2**20 == pytest.approx(m["n_layer"] * 2 * 2 * m["n_head"] * 16 * head_dim * 4)
    assert hf["graphs"] is None and hf["ttft_vs_hf"] is None
    # The floor reads every weight once plus the keys and values of the 16-slot window (2 rows, fp32).
    kv = m["n_layer"] * 2 * 2 * m["n_head"] * 16 * head_dim * 4
    assert floor["bytes_per_decode_step"] == pytest.approx(m["weights_mb"] * 2**20 + kv)
    ours = rows["ours"]
    held = m["weights_mb"] + ours["cache_mb"]
    assert ours["memory_ratio"] == pytest.approx((held + ours["peak_mb"]) / held)


def test_bench_rejects_bad_settings(capsys):
    with pytest.raises(SystemExit):
        generate_bench.main(["--prompt_len", "10", "--new_tokens", "10", "--max_length", "16"])
    assert "exceeds max_length" in capsys.readouterr().err


def test_packed_bf16_weights_change_no_logit(make_ckpt):
    """The CPU bf16 weight packing (``CpuLinear.pack``, the fallback where our kernels cannot be
    built) must not change a single bit of the prefill or decode logits."""
    import torch

    from bloom_hpu.loading import load_model
    from bloom_hpu.runtime.cpu import CpuOptions, accelerate, capability

    if not capability.onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    plain, _ = load_model(folder, torch.bfloat16)
    packed, _ = load_model(folder, torch.bfloat16)
    accelerate(packed, CpuOptions(path="onednn"))
    accelerate(plain, CpuOptions(path="plain"))
    assert all(m.packed is not None for b in packed.h for m in (b.self_attention.query_key_value, b.mlp.dense_4h_to_h))
    for block in packed.h:  # the GELU fused into oneDNN's product rounds once less: not what is compared here
        block.mlp.dense_h_to_4h.fused_gelu, block.mlp.gelu = False, plain.h[0].mlp.gelu
    ids = torch.randint(5, 500, (3, 12))
    lengths = torch.tensor([12, 4, 7])
    caches = [m.allocate_cache(3, 24) for m in (plain, packed)]
    with torch.no_grad():
        a, b = plain.prefill(ids, lengths, caches[0]), packed.prefill(ids, lengths, caches[1])
        assert torch.equal(a, b)
        positions = lengths.clone()
        for _ in range(6):
            token = a.argmax(-1)[:, None]
            a = plain.decode(token, positions, caches[0], 24)
            b = packed.decode(token, positions, caches[1], 24)
            assert torch.equal(a, b)
            positions += 1


@pytest.mark.parametrize("mode", [[], ["--attention_only"]], ids=["prefill", "attention-only"])
def test_prompt_attention_bench_runs_both_ways(mode, capsys):
    from bench import prompt_attention_bench
    from isas import KERNEL_ISAS

    code = prompt_attention_bench.main(["--config", "tiny", "--padded", "24", "--real", "9", "--repeats", "2", *mode])
    printed = capsys.readouterr().out
    if not KERNEL_ISAS:  # no kernel on this CPU: it says so and fails
        assert code == 1 and "no one-call prompt attention" in printed
        return
    assert code == 0
    assert ("one block's attention" if mode else "prefill") + " of 9 real tokens padded to 24" in printed
    assert "one call" in printed and "op by op" in printed


def test_cpu_products_bench_times_fp32_against_bf16_per_kernel_build(capsys):
    """``cpu_products_bench.py --dtypes``: one line per kernel build this CPU runs and row count,
    with both times and their ratio."""
    from isas import KERNEL_ISAS

    from bench import cpu_products_bench

    if not KERNEL_ISAS:
        pytest.skip("no kernel build runs here")
    cpu_products_bench.few_rows_dtypes(1, [1, 3])
    lines = [line for line in capsys.readouterr().out.splitlines() if "bf16 / fp32" in line]
    assert len(lines) == 2 * len(KERNEL_ISAS)
    for line in lines:
        fp32, bf16, ratio = map(float, re.search(r"fp32 +(\S+) +bf16 +(\S+) +bf16 / fp32 +(\S+)", line).groups())
        assert fp32 > 0 and bf16 > 0 and ratio == pytest.approx(bf16 / fp32, abs=0.01)
