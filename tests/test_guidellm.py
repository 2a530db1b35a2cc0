"""A load generator no one here wrote: guidellm (from .venv-guidellm/, made by
utils/guidellm/setup.sh), unmodified, against ``./bloom.py --serve``. It sends vLLM's extensions
(``ignore_eos``, ``stream_options.continuous_usage_stats``) with every request, on the completions
and the chat endpoint, 4 streams at once; every request must succeed with the tokens it asked for,
and each completion's text must be transformers' greedy continuation of its prompt.

Skipped when the venv is absent, unless BLOOM_GUIDELLM=required (as .ci/run sets it): then a missing
venv fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client_venvs import client_or_skip
from servers import free_port, wait_until_healthy

pytestmark = pytest.mark.slow  # an outside client in its own virtual environment, against a real server

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "bloom-tiny"
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 12, 24, 12


@pytest.fixture(scope="module")
def guidellm():
    return client_or_skip("guidellm", "guidellm", "BLOOM_GUIDELLM")


@pytest.fixture(scope="module")
def server():
    """./bloom.py --serve on the embedded checkpoint: its port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "bloom.py", "--serve", "--weights", str(CHECKPOINT.parent),
                             "--model", CHECKPOINT.name, "--port", str(port), "--max_length", "128",
                             "--max_batch", "4", "--bucket_width", "32"], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_until_healthy(proc, port, 120, log=lambda: proc.stderr.read() if proc.poll() is not None else "")
    yield port
    proc.send_signal(signal.SIGINT)
    proc.wait(30)


def run_guidellm(guidellm: Path, port: int, endpoint: str, work: Path) -> dict:
    """One guidellm benchmark (its ``run`` command): REQUESTS synthetic requests, 4 at a time,
    greedy (temperature 0 through its ``extras``); returns the benchmark of its JSON report."""
    backend = {"kind": "openai_http", "target": f"http://127.0.0.1:{port}", "request_format": endpoint,
               "extras": {"body": {"temperature": 0}}}
    report = work / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(work / "hf"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([str(guidellm), "run", "--backend", json.dumps(backend),
                           "--profile", "kind=concurrent,streams=4", "--constraint", f"kind=max_requests,count={REQUESTS}",
                           "--tokenizer", f"kind=huggingface_auto,model={CHECKPOINT}",
                           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                           "--output", f"kind=json,path={report}", "--disable-console"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    return benchmark


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_against_the_server(guidellm, server, endpoint, tmp_path):
    benchmark = run_guidellm(guidellm, server, endpoint, tmp_path)
    assert benchmark["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                      "total": REQUESTS}
    requests = benchmark["requests"]["successful"]
    bodies = [json.loads(r["request_args"])["body"] for r in requests]
    for body, request in zip(bodies, requests):
        # What vLLM's clients send, and what the server gave back: the tokens asked for, counted by
        # the server's usage (continuous_usage_stats) and streamed one or more per chunk.
        assert body["ignore_eos"] is True and body["stream_options"]["continuous_usage_stats"] is True
        assert request["output_tokens"] == OUTPUT_TOKENS
    if endpoint == "/v1/completions":  # (a chat prompt is its template's text around the message)
        assert all(request["prompt_tokens"] == PROMPT_TOKENS for request in requests)
        from transformers import AutoTokenizer, BloomForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
        hf = BloomForCausalLM.from_pretrained(CHECKPOINT, torch_dtype=torch.float32).eval()
        for body, request in zip(bodies, requests):
            ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
            with torch.no_grad():  # eos_token_id=None: EOS ends nothing, as ignore_eos asks
                out = hf.generate(ids, max_new_tokens=OUTPUT_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
            assert request["output"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
