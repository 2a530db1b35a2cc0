"""Kill-and-resume: a real ``bloom.py --requests`` process is SIGKILLed mid-run, then started again;
no request may be lost or answered twice, and the answers equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from generation.jobs.runner import run_requests

ROOT = Path(__file__).resolve().parent.parent
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def write_requests(path: Path) -> list[dict]:
    requests = []
    for i in range(60):
        prompt = f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]} {i}"
        requests.append({"prompt": prompt, "max_tokens": 4 + i % 3, "temperature": 0, "logprobs": i % 2})
    requests += requests[:5]  # exact duplicates must be answered as many times as they appear
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return requests


def key(request: dict) -> str:
    return json.dumps(request, sort_keys=True)


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(scoring_setup, tmp_path):
    folder, gen, _ = scoring_setup
    requests_file, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests = write_requests(requests_file)
    cmd = [sys.executable, str(ROOT / "bloom.py"), "--weights", str(folder), "--requests", str(requests_file),
           "--results", str(results), "--budget", "32", "--quiet"]  # one request per batch: many batches
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if results.exists() and results.stat().st_size > 0:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # after the first flushed batch, in the middle of the run
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    first_run = results.read_bytes()
    assert 0 < first_run.count(b"\n") < len(requests), "the kill must land mid-run"
    # Simulate a kill in the middle of a write too: a torn, unterminated last line.
    with open(results, "ab") as f:
        f.write(b'{"request": {"prompt": "torn')

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "already answered" in resumed.stderr

    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert results.read_bytes().startswith(first_run)  # nothing written before was rewritten
    assert Counter(key(r["request"]) for r in records) == Counter(key(r) for r in requests)

    # The answers equal those of one uninterrupted run.
    clean = tmp_path / "clean.jsonl"
    run_requests(gen, requests_file, clean, budget=32, progress=False)
    expected = {key(r["request"]): r["result"]["choices"] for r in map(json.loads, clean.read_text().splitlines())}
    for r in records:
        got, want = r["result"]["choices"], expected[key(r["request"])]
        assert [c["text"] for c in got] == [c["text"] for c in want]
        assert [c["finish_reason"] for c in got] == [c["finish_reason"] for c in want]
