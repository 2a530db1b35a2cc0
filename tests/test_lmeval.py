"""An evaluation harness no one here wrote: EleutherAI's lm-eval (its ``local-completions`` model,
from .venv-lmeval/, made by utils/lmeval/setup.sh) runs our LAMBADA task YAML against
``./bloom.py --serve`` and reports the accuracy and perplexity that ``./bloom.py --eval`` reports on
the same weights and passages; its per-passage numbers are transformers' own.

Skipped when the venv is absent, unless BLOOM_LMEVAL=required (as .ci/run sets it): then a missing
venv fails the test.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bloom
from generation.jobs.evaluate import split_last_word
from client_venvs import client_or_skip
from servers import free_port, wait_until_healthy

pytestmark = pytest.mark.slow  # an outside client in its own virtual environment, against a real server

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "utils" / "lmeval" / "lambada_local.yaml"
PASSAGES = 16


@pytest.fixture(scope="module")
def lm_eval():
    return client_or_skip("lmeval", "lm_eval", "BLOOM_LMEVAL")


def corpus_passages(hf, tokenizer) -> list[str]:
    """Runs of 12-36 words of the tiny corpus, each then a last word: every other one transformers'
    own greedy next word (so accuracy is not 0), the others the corpus' next word."""
    words = (ROOT / "utils" / "tiny_corpus.txt").read_text().split(" ")
    texts, at = [], 0
    for i in range(PASSAGES):
        length = 12 + (i * 7) % 25  # 12..36 words: passages of many lengths
        context = " ".join(words[at:at + length])
        at += length + 1
        if i % 2 == 0:
            ids = tokenizer.encode(context)
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                                  pad_token_id=3)
            greedy = tokenizer.decode(out[0, len(ids):].tolist()).split()
            texts.append(f"{context} {greedy[0] if greedy else 'zebra'}")
        else:
            texts.append(f"{context} {words[at - 1]}")
    return texts


def reference(hf, tokenizer, text: str) -> tuple[float, bool]:
    """transformers' log-likelihood of the last word and whether greedy decoding produces it, with
    lm-eval's tokenization (context + target whole, cut at the context's token count)."""
    context, target = split_last_word(text)
    whole, ctx = tokenizer.encode(context + target), tokenizer.encode(context)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
    steps = range(len(ctx) - 1, len(whole) - 1)  # row t predicts token t + 1
    return sum(logp[t, whole[t + 1]].item() for t in steps), all(logp[t].argmax().item() == whole[t + 1] for t in steps)


def start_server(folder: Path, port: int) -> subprocess.Popen:
    """./bloom.py --serve on ``folder``, once /health answers 200."""
    proc = subprocess.Popen([sys.executable, "bloom.py", "--serve", "--weights", str(folder), "--port", str(port),
                             "--max_length", "128", "--max_batch", "4", "--bucket_width", "32"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_until_healthy(proc, port, 120, log=lambda: proc.stderr.read() if proc.poll() is not None else "")
    return proc


def run_lm_eval(lm_eval: Path, folder: Path, port: int, data: Path, work: Path) -> tuple[dict, list[dict]]:
    """lm_eval with our task YAML (only its data file changed): (results of the task, samples)."""
    task_dir = work / "task"
    task_dir.mkdir()
    yaml, count = re.subn(r"(?m)^(\s+test: ).*$", rf"\g<1>{data}", TASK.read_text())
    assert count == 1
    (task_dir / TASK.name).write_text(yaml)
    model_args = (f"base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={folder},"
                  f"tokenizer_backend=huggingface,model={folder.name},num_concurrent=2,max_retries=1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # --batch_size 3: requests of three token-id prompts each (and a short last one).
    done = subprocess.run([str(lm_eval), "--model", "local-completions", "--model_args", model_args,
                           "--batch_size", "3", "--include_path", str(task_dir), "--tasks", "lambada_local",
                           "--output_path", str(work / "out"), "--log_samples"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next((work / "out").rglob("results_*.json")).read_text())["results"]["lambada_local"]
    samples = [json.loads(line) for line in next((work / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    return results, sorted(samples, key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def server(scoring_setup):
    """./bloom.py --serve on the scoring checkpoint: its port."""
    port = free_port()
    proc = start_server(scoring_setup[0], port)
    yield port
    proc.send_signal(signal.SIGINT)
    proc.wait(30)


def test_lm_evals_scoring_request(server, scoring_setup):
    """The body lm-eval's local-completions sends to score (token-id prompts, echo, max_tokens 1,
    logprobs 1, temperature 0, seed), through the official client: OpenAI's answer, whose numbers are
    transformers' log_softmax on the same weights."""
    import openai

    folder, gen, hf = scoring_setup
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = [gen.tokenizer.encode(t) for t in ("the river ran fast under the old stone bridge", "one, two, three")]
    r = client.completions.create(model=folder.name, prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                                  temperature=0, seed=1234)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, ids in zip(r.choices, prompts):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len(ids), vocab]
        greedy = logp[-1].argmax().item()
        lp = choice.logprobs
        assert choice.text == gen.tokenizer.decode(ids + [greedy]) and "".join(lp.tokens) == choice.text
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [logp[t - 1, ids[t]].item() for t in range(1, len(ids))] + [logp[-1, greedy].item()]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        for t, (value, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:])):
            # lm-eval's greedy test: the token's log-prob is the largest of top_logprobs.
            assert max(top.values()) == pytest.approx(logp[t].max().item(), abs=1e-4)
            assert (value == max(top.values())) == (t == len(ids) - 1 or logp[t].argmax().item() == ids[t + 1])
    scored = client.completions.create(model=folder.name, prompt=prompts[0], echo=True, max_tokens=0, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(r.choices[0].logprobs.token_logprobs[1:-1],
                                                                          abs=1e-4)


def test_lm_eval_against_the_server_matches_eval(lm_eval, server, scoring_setup, tmp_path):
    folder, gen, hf = scoring_setup
    texts = corpus_passages(hf, gen.tokenizer)
    assert max(len(gen.tokenizer.encode(t)) for t in texts) < 127  # fits the server's max_length with one token more
    data = tmp_path / "passages.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    results, samples = run_lm_eval(lm_eval, folder, server, data, tmp_path)

    # lm-eval's split of each passage and its per-passage numbers are transformers' (teacher-forced).
    assert [s["doc"]["text"] for s in samples] == texts
    expected = [reference(hf, gen.tokenizer, t) for t in texts]
    for sample, text, (ll, greedy) in zip(samples, texts, expected):
        context, target = split_last_word(text)
        assert (sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]) == (context, target)
        assert float(sample["resps"][0][0][0]) == pytest.approx(ll, abs=1e-3)
        assert sample["acc"] == greedy
    accuracy = sum(greedy for _, greedy in expected) / len(texts)
    assert 0 < accuracy < 1

    # ./bloom.py --eval on the same weights and passages reports the same two numbers.
    numbers_file = tmp_path / "eval.json"
    assert bloom.main(["--weights", str(folder), "--eval", str(data), "--results", str(numbers_file), "--quiet"]) == 0
    numbers = json.loads(numbers_file.read_text())
    assert results["sample_len"] == numbers["passages"] == len(texts)
    assert results["acc,none"] == numbers["accuracy"] == accuracy
    assert results["perplexity,none"] == pytest.approx(numbers["last_word_perplexity_per_word"], rel=1e-4)
    assert results["perplexity,none"] == pytest.approx(math.exp(-sum(ll for ll, _ in expected) / len(texts)), rel=1e-4)
