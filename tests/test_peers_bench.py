"""bench/peers_bench.py's bookkeeping (no engine runs here: a real run converts a checkpoint with
each peer's converter, minutes of CPU; see the script's docstring)."""

from __future__ import annotations

import time

import pytest

from bench import peers_bench as pb

SPEC = {"decode_tokens": 5, "batch_new": 4, "prompts": {"b8": [{}] * 8}, "formats": ["fp32", "bf16", "int8i"],
        "group_size": 32}


def samples(first16, decode, prompt128, batch8):
    return {"samples": {"first16": [first16], "decode": [decode], "prompt128": [prompt128], "batch8": [batch8]}}


def test_figures_from_samples():
    f = pb.figures(samples(0.010, 0.050, 0.100, 2.0)["samples"], SPEC)
    assert f["first16_ms"] == pytest.approx(10)
    assert f["decode_ms_per_token"] == pytest.approx(10)  # (50 - 10) ms / (5 - 1) tokens
    assert f["prompt128_ms"] == pytest.approx(100)
    assert f["batch8_tokens_per_s"] == pytest.approx(16)  # 8 rows x 4 tokens / 2 s


def test_each_peer_runs_a_weight_format_once_and_only_where_it_has_it():
    formats = ["fp32", "bf16", "int8", "int4", "int8i", "int4i"]
    assert pb.engine_formats("ours", formats) == formats
    assert pb.engine_formats("llama.cpp", formats) == ["fp32", "bf16", "int8", "int4"]
    assert pb.engine_formats("ctranslate2", formats) == ["fp32", "int8"]  # no bfloat16 nor int4 on a CPU


def test_rows_ratios_against_the_best_peer_and_notes():
    results = {"ours": {"fp32": samples(0.02, 0.10, 0.2, 2.0), "bf16": samples(0.01, 0.05, 0.1, 1.0),
                        "int8i": {"skipped": "no int8_activations"}},
               "llama.cpp": {"fp32": samples(0.01, 0.09, 0.4, 4.0), "int8": samples(0.01, 0.05, 0.1, 1.0)},
               "ctranslate2": {"fp32": samples(0.04, 0.08, 0.1, 1.0)}}
    rows = {r["format"]: r for r in pb.build_rows(results, SPEC)}
    fp32 = rows["fp32"]["ratios"]
    assert fp32["first16_ms"] == pytest.approx(2.0)  # 20 ms / llama.cpp's 10
    assert fp32["prompt128_ms"] == pytest.approx(2.0)  # 200 ms / CTranslate2's 100
    assert fp32["batch8_tokens_per_s"] == pytest.approx(0.5)  # 16 tok/s / CTranslate2's 32
    assert rows["bf16"]["ratios"] == {}  # no peer ran bf16: no ratio
    assert "llama.cpp" not in rows["bf16"]["values"]["first16_ms"]
    assert rows["int8i"]["notes"] == ["ours: skipped (no int8_activations)"]
    assert rows["int8i"]["values"]["first16_ms"] == {"llama.cpp": pytest.approx(10)}


def test_fp32_token_check_and_agreement():
    same = {"tokens": {"decode": [[5, 6, 2, 9]], "batch8": [[1, 2], [3, 4]]}}
    after_eos = {"tokens": {"decode": [[5, 6, 2, 7]], "batch8": [[1, 2], [3, 4]]}}
    results = {"ours": {"fp32": same}, "llama.cpp": {"fp32": after_eos}}
    assert pb.fp32_check(results) is None  # what follows an EOS does not count
    results["ctranslate2"] = {"fp32": {"tokens": {"decode": [[5, 7, 2]], "batch8": [[1, 2], [3, 4]]}}}
    assert "ctranslate2 differs" in pb.fp32_check(results)
    lines = pb.agreement(results, ["fp32"])
    assert "decode: 0/1 rows identical (tokens before the first difference: 1)" in lines[1]


def test_ours_extra_parses_literals():
    assert pb.parse_extra("int8_activations=True, cpu_path=avx2,group_size=64") == {
        "int8_activations": True, "cpu_path": "avx2", "group_size": 64}
    with pytest.raises(SystemExit):
        pb.parse_extra("int8_activations")


def test_ours_runs_with_the_measured_routes_by_default(monkeypatch):
    monkeypatch.setenv("BLOOM_CPU_CHOICE", "static")  # as the suite sets it: the bench must not inherit it
    spec = dict(SPEC, ours_extra={}, quant_dtype="bf16")
    assert pb.ours_keywords(spec, "int8") == {"cpu": {"choice": "measure"}, "dtype": "bf16", "quantize": "int8",
                                              "group_size": None}
    assert pb.ours_keywords(spec, "bf16")["cpu"] == {"choice": "measure"}
    from bloom_hpu.runtime.cpu import CpuOptions, choice

    assert choice.mode(CpuOptions(**pb.ours_keywords(spec, "fp32")["cpu"]).choice) == "measure"
    spec["ours_extra"] = pb.parse_extra("cpu_choice=static,cpu_path=avx2")
    assert pb.ours_keywords(spec, "int4i")["cpu"] == {"choice": "static", "path": "avx2"}


def test_the_table_says_which_routes_ours_picked():
    line = ("AVX512-BF16 kernels: few-rows products (CPU flags: AVX512-BF16); "
            "routes prompts 1-16 native, 17-64 kernel, 65+ kernel, decode native (measured)")
    assert pb.routes_of("tree: Generator.from_pretrained(dtype='bf16'); bucket_width 16; " + line) == \
        "prompts 1-16 native, 17-64 kernel, 65+ kernel, decode native (measured)"
    assert pb.routes_of("PyTorch operations (--cpu_path plain)") is None
    results = {"ours": {"bf16": dict(samples(0.01, 0.05, 0.1, 1.0), describe=f"x; {line}")}}
    report = {"spec": dict(SPEC, formats=["bf16"], threads=2, repeats=1, rounds=1, vocab=1, hidden=1, layers=1,
                           heads=1),
              "cpu": {"model": "a CPU", "cpus": 2, "isa": []}, "load_before": [0, 0, 0], "load_after": [0, 0, 0],
              "shape": "tiny", "versions": {}}
    report["rows"] = pb.build_rows(results, report["spec"])
    assert "bf16 / BF16 / -: prompts 1-16 native, 17-64 kernel, 65+ kernel, decode native (measured)" in \
        pb.markdown(report)


def test_decode_interleaved_alternates_the_engines_pair_by_pair():
    """bench/decode_interleaved.py: each pair times both engines (a one-token request, then the
    long one), the first engine of a pair alternating, and the ratio is ours' over llama.cpp's."""
    from bench import decode_interleaved

    calls = []

    class Fake:
        def __init__(self, name, seconds_a_token):
            self.name, self.seconds = name, seconds_a_token

        def generate(self, ids, n):
            calls.append((self.name, n))
            time.sleep(self.seconds * n)

    pairs = decode_interleaved.interleaved([Fake("ours", 0.001), Fake("llama.cpp", 0.002)], [1, 2, 3], 9, 3)
    assert [name for name, n in calls if n == 9] == ["ours", "llama.cpp", "llama.cpp", "ours", "ours", "llama.cpp"]
    assert [n for _, n in calls] == [1, 9] * 6
    assert all(0.2 < ours / llama < 0.8 for ours, llama in pairs)  # 1 ms a token against 2
