"""The server under the deepspeed launcher on 2 ranks (rank 0 answers HTTP, the other rank follows
each step) answers what one process answers: greedy, seeded samples, log-probs, stop strings,
beams and echo scoring (the batch runner's path), rows of a served LoRA adapter beside the base
model's, sent concurrently."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from servers import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent
SERVE = ["--serve", "--max_batch", "4", "--max_length", "48", "--bucket_width", "16", "--max_prefill", "2"]

REQUESTS = [
    dict(prompt="the cat sat on", max_tokens=12, temperature=0),
    dict(prompt="a", max_tokens=20, temperature=0, logprobs=2),
    dict(prompt="once upon a time there was a very long prompt indeed, longer than the others", max_tokens=8,
         temperature=0, stop=[" the"]),
    dict(prompt="seeded", max_tokens=10, temperature=0.8, seed=3, n=2, extra_body={"top_k": 20}),
    dict(prompt="hello world", max_tokens=6, temperature=0, n=2, extra_body={"num_beams": 3}),
    dict(prompt="score this text", max_tokens=0, echo=True, logprobs=1),
    dict(prompt="and then", max_tokens=15, temperature=0, frequency_penalty=1.0),
    dict(prompt="x y z", max_tokens=9, temperature=0.5, seed=11),
    # Structured output: rank 0 alone keeps the matchers; best_of > n runs on every rank's generate.
    dict(prompt="record", max_tokens=30, temperature=0, extra_body={"guided_json": {
        "type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
        "required": ["a", "b"], "additionalProperties": False}}),
    dict(prompt="pick", max_tokens=12, temperature=0.7, seed=2, n=2, extra_body={"guided_regex": "[a-z]{1,5} [0-9]{2}"}),
    dict(prompt="best", max_tokens=8, temperature=0.9, seed=1, best_of=2, extra_body={"guided_choice": ["up", "down"]}),
    dict(prompt="the cat sat on", max_tokens=12, temperature=0, model="tuned"),
    dict(prompt="hello world", max_tokens=6, temperature=0, n=2, extra_body={"num_beams": 3}, model="tuned"),
]


def start(command: list[str], port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(log_path, "w")
    # Its own process group: the launcher and its ranks are stopped together.
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(proc, port, 300, log=lambda: log_path.read_text()[-4000:])
    except AssertionError:
        stop(proc)
        raise
    return proc


def launch(checkpoint, serve: list[str], ranks: int, log_path: Path) -> tuple[subprocess.Popen, int]:
    """``./bloom.py --serve`` as one process, or on ``ranks`` ranks under the deepspeed launcher;
    returns (process, port) once it is healthy."""
    port = free_port()
    prefix = [sys.executable]
    if ranks > 1:
        prefix += ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port())]
    return start([*prefix, "bloom.py", "--weights", str(checkpoint), *serve, "--port", str(port)], port, log_path), port


def stop(proc: subprocess.Popen) -> int:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)


def answers(port: int, model: str) -> list[list]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)

    def ask(request):
        out = client.completions.create(**({"model": model} | request))
        return [(c.text, c.finish_reason, c.logprobs.model_dump() if c.logprobs else None) for c in out.choices]

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(ask, REQUESTS))


def same_choices(have, want, request) -> None:
    """Texts, finish reasons and tokens equal; log-probs within float noise (the ranks sum their
    halves of each product in another order than one process)."""
    assert [(text, finish) for text, finish, _ in have] == [(text, finish) for text, finish, _ in want], request
    for (_, _, mine), (_, _, theirs) in zip(have, want):
        assert (mine is None) == (theirs is None), request
        if mine is None:
            continue
        assert mine["tokens"] == theirs["tokens"] and mine["text_offset"] == theirs["text_offset"], request
        assert mine["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-4, nan_ok=True), request
        for top_mine, top_theirs in zip(mine["top_logprobs"] or [], theirs["top_logprobs"] or []):
            assert (top_mine is None) == (top_theirs is None), request
            if top_mine is None:  # echo: the prompt's first token has none
                continue
            assert top_mine.keys() == top_theirs.keys(), request
            assert list(top_mine.values()) == pytest.approx([top_theirs[k] for k in top_mine], abs=1e-4), request


@pytest.fixture(scope="module")
def checkpoint(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=5)


@pytest.mark.slow
def test_two_ranks_serve_what_one_process_serves(checkpoint, tmp_path):
    from lora_adapters import make_adapter

    adapter = make_adapter(checkpoint, tmp_path / "adapter", seed=2, r=4, lora_alpha=8,
                           target_modules=["query_key_value", "dense_4h_to_h"])
    serve = [*SERVE, "--lora", f"tuned={adapter}"]
    one, port = launch(checkpoint, serve, 1, tmp_path / "one.log")
    try:
        expected = answers(port, checkpoint.name)
    finally:
        stop(one)

    two, port = launch(checkpoint, serve, 2, tmp_path / "two.log")
    try:
        got = answers(port, checkpoint.name)
        got_again = answers(port, checkpoint.name)  # a second load over the same ranks, in another mix
    finally:
        stop(two)
    log = (tmp_path / "two.log").read_text()
    assert "num_local_procs=2" in log and "warm-up:" in log, log[-3000:]
    for request, want, have, again in zip(REQUESTS, expected, got, got_again):
        same_choices(have, want, request)
        same_choices(again, want, request)
    assert any(text for choices in expected for text, _, _ in choices)
    assert expected[0] != expected[-2]  # the adapter changes the answer


@pytest.mark.slow
def test_an_idle_two_rank_server_outlives_its_collective_timeout(checkpoint, tmp_path, monkeypatch):
    """Rank 0 sends heartbeats while idle, so the follower's wait never reaches the collective
    timeout (8 s here): after 20 idle seconds the server still answers what one process answers."""
    import time

    request = dict(prompt="the cat sat on", max_tokens=8, temperature=0)
    client = lambda port: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                        timeout=60)
    monkeypatch.setenv("BLOOM_COLLECTIVE_TIMEOUT", "8")
    one, port = launch(checkpoint, SERVE, 1, tmp_path / "one.log")
    try:
        want = client(port).completions.create(model=checkpoint.name, **request).choices[0].text
    finally:
        stop(one)
    two, port = launch(checkpoint, SERVE, 2, tmp_path / "two.log")
    try:
        time.sleep(20)
        assert two.poll() is None, (tmp_path / "two.log").read_text()[-3000:]
        assert client(port).completions.create(model=checkpoint.name, **request).choices[0].text == want
    finally:
        stop(two)


def test_the_collective_timeout_is_a_checked_setting(monkeypatch):
    from bloom_hpu.runtime.launch import DEFAULT_COLLECTIVE_TIMEOUT, collective_timeout
    from bloom_hpu.tp import ParallelError

    monkeypatch.delenv("BLOOM_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == DEFAULT_COLLECTIVE_TIMEOUT
    monkeypatch.setenv("BLOOM_COLLECTIVE_TIMEOUT", "12.5")
    assert collective_timeout() == 12.5
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv("BLOOM_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ParallelError, match="BLOOM_COLLECTIVE_TIMEOUT"):
            collective_timeout()
