"""Tensor parallelism: per-rank slices of the checkpoint, the checks, and a real 2-rank run.

The 2-rank run starts this very file under the `deepspeed` launcher (see ``_worker`` at the bottom):
each rank loads its half of a random checkpoint over gloo, computes logits, greedy, beam and sampled
outputs, checks the argument-agreement error, then runs the CLI (``bloom.main``) in the same
process group. The test compares all of it with the same work done by one process here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bloom_hpu.alibi import alibi_slopes
from bloom_hpu.config import BloomConfig
from bloom_hpu.loading import load_model
from bloom_hpu.runtime.launch import _RankPrefixed, launch_info
from bloom_hpu.tp import Parallel, ParallelError, check_splittable

ROOT = Path(__file__).resolve().parent.parent
CKPT = dict(hidden_size=64, n_layer=2, n_head=4, seed=7)  # vocab 1024
# The 2-rank run uses a vocabulary that does not divide by 2 (a resized vocabulary): rank 1's shard
# ends in a pad row, which must never be chosen and must not change a single logit.
ODD = dict(CKPT, vocab_size=1001)
PROMPTS = ["Hello", "The quick brown fox jumps over the", "A b"]  # mixed lengths, one batch
GREEDY = dict(max_length=24)
BEAM = dict(max_length=20, num_beams=3, num_return_sequences=2)
SAMPLE = dict(max_length=20, do_sample=True, top_k=20)  # no seed: ranks must still agree
CLI_ARGS = ["--max_length", "20", "--batch_size", "3", "--quiet", *PROMPTS]


# ---------------------------------------------------------------------------------------------
# Slicing: every rank's slices put back together are the full weight


def _split_dim(name: str) -> int | None:
    """Along which dim ranks split checkpoint tensor ``name``; None: replicated."""
    if name == "word_embeddings.weight" or ".query_key_value." in name or ".dense_h_to_4h." in name:
        return 0
    if name.endswith("self_attention.dense.weight") or name.endswith("dense_4h_to_h.weight"):
        return 1
    return None


@pytest.mark.parametrize("fmt", ["safetensors-sharded", "bin"])
@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_concatenate_to_full_weights(make_ckpt, fmt, world):
    folder = make_ckpt(**CKPT, fmt=fmt)
    full, full_report = load_model(folder)
    shards = [load_model(folder, parallel=Parallel(rank, world)) for rank in range(world)]
    full_params = dict(full.named_parameters())

    for name, weight in full_params.items():
        parts = [dict(m.named_parameters())[name] for m, _ in shards]
        dim = _split_dim(name)
        if dim is None:
            for part in parts:
                assert torch.equal(part, weight), name
        else:
            assert all(p.shape[dim] == weight.shape[dim] // world for p in parts), name
            assert torch.equal(torch.cat(parts, dim=dim), weight), name

    # Each rank keeps its own heads' ALiBi slopes, in head order.
    assert torch.equal(torch.cat([m.slopes for m, _ in shards]), alibi_slopes(CKPT["n_head"]))
    assert all(m.local_heads == CKPT["n_head"] // world for m, _ in shards)

    # Each rank read exactly the bytes of what it holds (stored fp32), not the whole checkpoint.
    for model, report in shards:
        held = sum(p.numel() * 4 for p in model.parameters())
        assert report.bytes_read == held
        assert report.checkpoint_bytes == full_report.bytes_read
        assert report.bytes_read < full_report.bytes_read * (1 / world + 0.1)
        assert f"rank {report.rank}/{world}" in report.describe()


def test_fused_qkv_is_split_by_whole_heads(make_ckpt):
    # The fused rows are [head, (q, k, v), head_dim]: rank r must hold heads r*H/N .. (r+1)*H/N-1
    # complete, i.e. their q, k and v rows, not a block of all the q rows.
    folder = make_ckpt(**CKPT, fmt="safetensors-sharded")
    full, _ = load_model(folder)
    h, d = CKPT["n_head"], CKPT["hidden_size"] // CKPT["n_head"]
    qkv = full.h[0].self_attention.query_key_value.weight.view(h, 3, d, -1)
    rank1, _ = load_model(folder, parallel=Parallel(1, 2))
    local = rank1.h[0].self_attention.query_key_value.weight.view(h // 2, 3, d, -1)
    assert torch.equal(local, qkv[h // 2 :])


# ---------------------------------------------------------------------------------------------
# Clear errors


def _config(n_head=4, vocab_size=1024):
    return BloomConfig(vocab_size=vocab_size, hidden_size=16 * n_head, n_layer=1, n_head=n_head)


def test_splittable_errors():
    check_splittable(_config(n_head=4), 4)  # fine
    with pytest.raises(ParallelError, match="8 ranks is more than the model's 4 attention heads"):
        check_splittable(_config(n_head=4), 8)
    with pytest.raises(ParallelError, match=r"12 attention heads cannot be split evenly over 8 ranks.*1, 2, 3, 4, 6, 12"):
        check_splittable(_config(n_head=12), 8)
    check_splittable(_config(n_head=8, vocab_size=1004), 8)  # any vocabulary: the last shard is padded


@pytest.mark.parametrize("world", [2, 4])
def test_a_vocabulary_that_does_not_divide_is_padded_on_the_last_rank(make_ckpt, world):
    folder = make_ckpt(**ODD, fmt="safetensors-sharded")
    full, _ = load_model(folder)
    shards = [load_model(folder, parallel=Parallel(rank, world))[0] for rank in range(world)]
    per = -(-1001 // world)
    weights = [m.word_embeddings.weight for m in shards]
    assert all(w.shape[0] == per for w in weights)
    joined = torch.cat(weights)
    assert torch.equal(joined[:1001], full.word_embeddings.weight)
    assert not joined[1001:].any()  # pad rows are zero
    # One rank's logits gathered by SINGLE's rule: the pad columns are dropped.
    assert Parallel().all_gather_last(torch.zeros(2, per * world), 1001).shape == (2, 1001)


def test_load_model_refuses_an_uneven_split(make_ckpt):
    folder = make_ckpt(**CKPT, fmt="safetensors-sharded")
    with pytest.raises(ParallelError, match="4 attention heads cannot be split evenly over 3 ranks"):
        load_model(folder, parallel=Parallel(0, 3))


def test_launch_info_from_launcher_environments():
    assert launch_info({}) is None
    assert launch_info({"WORLD_SIZE": "1", "RANK": "0"}) is None
    deepspeed = launch_info({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_SIZE": "4"})
    assert (deepspeed.rank, deepspeed.world_size, deepspeed.local_rank, deepspeed.local_size) == (5, 8, 1, 4)
    torchrun = launch_info({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert torchrun.local_size == 2
    with pytest.raises(ParallelError, match="incomplete"):
        launch_info({"WORLD_SIZE": "2"})
    with pytest.raises(ParallelError, match="outside"):
        launch_info({"WORLD_SIZE": "2", "RANK": "2"})


def test_other_ranks_lines_are_prefixed():
    class Sink:
        text = ""

        def write(self, t):
            self.text += t

    sink = Sink()
    out = _RankPrefixed(sink, "[rank 3] ")
    out.write("one\ntw")
    out.write("o\n\nthree\n")
    assert sink.text == "[rank 3] one\n[rank 3] two\n[rank 3] \n[rank 3] three\n"


# ---------------------------------------------------------------------------------------------
# The 2-rank run under the deepspeed launcher, against one process


def _outputs(generator) -> dict:
    """Everything compared between the 2-rank run and one process (run identically in both)."""
    from generation.run.batch import make_batch

    model, runner = generator.model, generator.runner
    batch = make_batch(generator.tokenizer, PROMPTS, generator.options(**GREEDY), generator.device)
    with torch.no_grad():
        cache = model.allocate_cache(len(PROMPTS), batch.plan.cache_len)
        full = model.full_logits(batch.input_ids, batch.lengths, cache)  # [B, P, V]
        last = runner.prefill(batch.input_ids, batch.lengths, runner.cache(len(PROMPTS), batch.plan.cache_len))
        step = runner.decode(last.argmax(-1)[:, None], batch.lengths, runner.cache(len(PROMPTS), batch.plan.cache_len),
                             batch.plan.window(0))
    real = torch.arange(full.shape[1])[None, :] < batch.lengths[:, None]  # [B, P]
    out = {"full_logits": full[real].clone(), "prefill": last.clone(), "decode": step.clone()}
    generator.backend.signatures.clear()
    out["greedy"] = [r.token_ids for r in generator.generate(PROMPTS, **GREEDY)]
    out["signatures"] = sorted(map(repr, generator.backend.signatures))
    out["beam"] = [[(s.token_ids, s.score) for s in r.sequences] for r in generator.generate(PROMPTS, **BEAM)]
    return out


@pytest.fixture(scope="module")
def two_rank_run(make_ckpt, tmp_path_factory):
    """Launch this file on 2 ranks with the deepspeed launcher; returns (ckpt, output folder)."""
    folder = make_ckpt(**ODD, fmt="safetensors-sharded")
    out = tmp_path_factory.mktemp("tp")
    with socket.socket() as s:  # a free port: other test runs may share the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The workers run this file as a script: the repository root reaches them through PYTHONPATH.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               __file__, "--tp-worker", str(folder), str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    return folder, out, log


@pytest.fixture(scope="module")
def single(make_ckpt):
    from generation.generator import Generator

    generator = Generator.from_pretrained(make_ckpt(**ODD, fmt="safetensors-sharded"), device="cpu")
    return _outputs(generator)


@pytest.fixture(scope="module")
def ranks(two_rank_run):
    _, out, _ = two_rank_run
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_two_ranks_load_half_each(ranks):
    for r, record in enumerate(ranks):
        assert (record["rank"], record["world_size"]) == (r, 2)
        report = record["report"]
        assert report.bytes_read < 0.6 * report.checkpoint_bytes


def test_two_ranks_agree_bitwise(ranks):
    a, b = ranks
    for key in ("full_logits", "prefill", "decode"):
        assert torch.equal(a[key], b[key]), key
    for key in ("greedy", "beam", "sampled", "signatures"):
        assert a[key] == b[key], key


def test_two_rank_logits_match_one_process(ranks, single):
    for key in ("full_logits", "prefill", "decode"):
        got, want = ranks[0][key], single[key]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # The test is only meaningful if the top token leads clearly (peaky random weights).
        assert torch.equal(got.argmax(-1), want.argmax(-1)), key


def test_two_rank_greedy_and_beam_match_one_process(ranks, single):
    assert ranks[0]["greedy"] == single["greedy"]
    # No id of the pad row that ends rank 1's shard (ids >= vocab_size) is ever produced.
    produced = [t for row in ranks[0]["greedy"] + ranks[0]["sampled"] for t in row]
    produced += [t for row in ranks[0]["beam"] for ids, _ in row for t in ids]
    assert max(produced) < ODD["vocab_size"]
    beams, want = ranks[0]["beam"], single["beam"]
    assert [[ids for ids, _ in row] for row in beams] == [[ids for ids, _ in row] for row in want]
    for row, want_row in zip(beams, want):
        for (_, score), (_, want_score) in zip(row, want_row):
            assert score == pytest.approx(want_score, abs=1e-4)


def test_two_ranks_keep_static_shapes(ranks, single):
    # Three prompt lengths, one prefill and one decode signature, as with one process.
    assert ranks[0]["signatures"] == single["signatures"]
    assert len(ranks[0]["signatures"]) == 2


def test_ranks_that_disagree_get_a_clear_error(ranks):
    for record in ranks:
        message = record["disagreement"]
        assert "ranks disagree on mine" in message and "rank 1 differs from rank 0" in message
        assert "same" not in message.split("(")[0]
        assert record["agreement_ok"]


def test_cli_under_deepspeed_matches_one_process(two_rank_run, single):
    _, out, log = two_rank_run
    rank0 = json.loads((out / "cli.json").read_text())
    rank1 = json.loads((out / "cli.rank1.json").read_text())  # written because of --all_ranks
    from generation.generator import Generator

    folder = two_rank_run[0]
    want = [r.token_ids for r in Generator.from_pretrained(folder, device="cpu").generate(PROMPTS, max_length=20)]
    assert [r["token_ids"] for r in rank0] == want
    assert rank1 == rank0
    assert "rank 0/2: loaded in" in log and "[rank 1] rank 1/2: loaded in" in log


# ---------------------------------------------------------------------------------------------
# What each rank runs (this file started by the deepspeed launcher)


def _worker(folder: str, out: str) -> int:
    import bloom
    from bloom_hpu.runtime.launch import check_agreement, init_parallel, sync_random_seed
    from generation.generator import Generator

    parallel = init_parallel("cpu")
    generator = Generator.from_pretrained(folder, device="cpu", parallel=parallel)
    record = {"rank": parallel.rank, "world_size": parallel.world_size, "report": generator.load_report}
    record |= _outputs(generator)
    sync_random_seed(parallel)
    record["sampled"] = [r.token_ids for r in generator.generate(PROMPTS, **SAMPLE)]
    try:
        check_agreement(parallel, {"same": 1, "mine": parallel.rank})
        record["disagreement"] = ""
    except ParallelError as error:
        record["disagreement"] = str(error)
    check_agreement(parallel, {"same": 1, "prompts": PROMPTS})
    record["agreement_ok"] = True
    torch.save(record, Path(out) / f"rank{parallel.rank}.pt")
    # The CLI in the same process group, as `deepspeed bloom.py ...` runs it (it ends the group).
    argv = [f"--local_rank={parallel.local_rank}", "--weights", folder, "--all_ranks",
            "--output_file", str(Path(out) / "cli.json"), *CLI_ARGS]
    return bloom.main(argv)


if __name__ == "__main__" and "--tp-worker" in sys.argv:
    torch.set_num_threads(1)
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
    from bloom_hpu.runtime.launch import exit_process

    # not sys.exit: a rank's interpreter exit can abort in the distributed stack's destructors
    exit_process(_worker(*args[args.index("--tp-worker") + 1 :]))
