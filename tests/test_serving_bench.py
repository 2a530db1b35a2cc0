"""Smoke test of bench/serve_bench.py on the tiny checkpoint: every variant and load runs and the
figures exist. No timing assertions: timings are the benchmark's job."""

import json

from bench import serve_bench


def test_serve_bench_runs_every_variant(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["--clients", "1,3", "--rates", "100", "--requests", "4", "--max_tokens", "3", "--max_batch", "4",
            "--max_length", "32", "--bucket_width", "16", "--prompt_len", "2,12", "--json", str(out)]
    assert serve_bench.main(argv) == 0
    printed = capsys.readouterr().out
    for column in ("tok/s", "TTFT p50", "ITL p99", "cores", "new shapes",
                   "ours at 3 clients: ", "x transformers, ", "x offline, p99 inter-token ",
                   "the 3-row decode step (", "the 1-row decode step (", " before, "):
        assert column in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["load"]) for r in rows] == [
        ("ours", "1 clients"), ("ours", "3 clients"), ("ours", "100 req/s"),
        ("transformers", "1 clients"), ("transformers", "3 clients"), ("transformers", "100 req/s"),
        ("offline", "one job")]
    assert all(r["requests"] == 4 and r["tokens"] > 0 and r["tok_s"] > 0 for r in rows)
    assert all(r["new_shapes"] == 0 for r in rows if r["variant"] == "ours")  # nothing after warm-up
    # Each level of ours has its yardstick, timed before and after it, for the rows it runs.
    ours = [r for r in rows if r["variant"] == "ours"]
    assert [r["decode_step_rows"] for r in ours] == [1, 3, 1]
    assert all(min(r["decode_step_timed"]) > 0 and r["decode_step_ms"] == sum(r["decode_step_timed"]) / 2 for r in ours)
    # The CPU both sides used: the server's process worked; the clients' process counted its own.
    served = [r for r in rows if r["variant"] != "offline"]
    assert all(r["server_cores"] > 0 and r["client_cores"] > 0 for r in served)


def test_serve_bench_times_the_draft_path_on_an_agreeing_target(tmp_path):
    """ours+draft:K on --agreeing_target: the target's blocks past the draft's add nothing, so the
    draft's guesses are the target's own choices and every one offered is accepted."""
    out = tmp_path / "serve.json"
    argv = ["--clients", "1", "--requests", "3", "--max_tokens", "8", "--max_batch", "4", "--max_length", "48",
            "--bucket_width", "16", "--prompt_len", "2,12", "--agreeing_target", "--draft_layers", "1",
            "--variants", "ours,ours+draft:3", "--json", str(out)]
    assert serve_bench.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ours"]["tokens"] == rows["ours+draft:3"]["tokens"] == 24
    drafted = rows["ours+draft:3"]
    assert drafted["verify_passes"] > 0 and drafted["offered"] > 0 and drafted["accepted"] == drafted["offered"]


def test_a_chunk_that_brings_several_tokens_counts_as_that_many_gaps():
    """Text held back for two steps arrives with three tokens: 300 ms over 3 tokens, 100 ms each;
    where the server does not count a chunk's tokens, each chunk is one token."""
    from bench.load_client import Timing

    counted = Timing(sent=0.0, chunks=[1.0, 1.1, 1.4], chunk_tokens=[1, 2, 5])
    assert [round(g, 6) for g in serve_bench.per_token_gaps(counted)] == [100.0, 100.0, 100.0, 100.0]
    uncounted = Timing(sent=0.0, chunks=[1.0, 1.1, 1.4])
    assert [round(g, 6) for g in serve_bench.per_token_gaps(uncounted)] == [100.0, 300.0]
