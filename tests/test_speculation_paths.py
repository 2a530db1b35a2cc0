"""Speculative decoding everywhere the library's token loop runs (generation/search/speculation.py):
streaming hooks, structured output, request files, the chat shell, LoRA adapters, prefix-cache
hits, int4 weights and two tensor-parallel ranks. Everywhere, greedy output with speculation is
the output without it (and transformers' or PEFT's where a reference exists), guesses having
really been accepted and rejected.

As in tests/test_speculation.py, random weights rarely repeat themselves, so the random
checkpoints' tests plant the *oracle* guesser (the plain run's own continuation, every third guess
wrong); the embedded default checkpoint's greedy text repeats itself, so there prompt lookup is
tried as it is.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bloom
from generation.generator import Generator
from generation.search import speculation
from test_speculation import PROMPTS, REPEATING, hf_greedy, ids_of, oracle

pytestmark = pytest.mark.usefixtures("verify_any_batch")  # batches past the CPU's step-aside

ROOT = Path(__file__).resolve().parent.parent


def use_guesser(monkeypatch, guesser) -> None:
    monkeypatch.setitem(speculation.GUESSERS, "ngram", guesser)


def outcome(results):
    """What a call gives back, every sequence: tokens, text and why it ended."""
    return [[(s.token_ids, s.text, s.finish_reason) for s in r.sequences] for r in results]


# --- streaming hooks ---------------------------------------------------------------------------------


def watched(generator, prompts, **options):
    """A call's results and its on_step calls [(tokens, done)], up to the first where every row is done."""
    calls = []

    def on_step(tokens, done):
        calls.append((tokens.tolist(), done.tolist()))

    results = generator.generate(prompts, on_step=on_step, **options)
    end = next((n for n, (_, done) in enumerate(calls) if all(done)), len(calls))
    return results, calls[: end + 1]


@pytest.mark.parametrize("options", [
    dict(ignore_eos=False),
    dict(ignore_eos=False, max_new_tokens_each=[20, 3, 11, 25, 1]),
], ids=["eos", "budgets"])
def test_the_hook_sees_the_plain_loops_steps(monkeypatch, eos_generator, options):
    """on_step gets the plain loop's calls, step by step (every row's n-th token, pad after a row's
    end, done from its last step on), several steps a pass; progress ticks once a step."""
    options = dict(max_length=36, **options)
    plain, plain_calls = watched(eos_generator, PROMPTS, **options)
    assert any(r.finish_reason == "eos" for r in plain)
    use_guesser(monkeypatch, oracle(eos_generator, PROMPTS, [r.token_ids for r in plain]))
    ticks = []
    monkeypatch.setattr("generation.generator.Progress.update", lambda self, n=1, postfix="": ticks.append(n))
    ours, calls = watched(eos_generator, PROMPTS, speculate="ngram:4", progress=True, **options)
    stats = eos_generator.last_stats.speculation
    assert outcome(ours) == outcome(plain)
    assert calls == plain_calls
    assert stats.verifies < len(calls) // 2 and 0 < stats.accepted < stats.offered  # several steps a pass
    assert len(ticks) == max(len(r.token_ids) for r in plain)


def test_streamed_text_is_the_final_text(tiny_checkpoint):
    """Generator.stream and the chat's generate_streaming, speculating (prompt lookup on text that
    repeats), give out pieces that join to the text without speculation, stop strings held back."""
    from generation.run.streaming import generate_streaming

    plain = Generator.from_pretrained(tiny_checkpoint)
    generator = Generator.from_pretrained(tiny_checkpoint, speculate="ngram:4")
    prompt = REPEATING[1]
    want = plain.generate(prompt, max_length=96)[0]
    pieces = list(generator.stream(prompt, max_length=96))
    assert len(pieces) > 3 and "".join(pieces) == want.text
    assert generator.last_stats.speculation.tokens_per_verify > 1.5
    stop = want.text[len(want.text) // 2 :][:6]  # a stop string from the middle of the text
    stopped = plain.generate(prompt, max_length=96, stop=stop)[0]
    assert stopped.finish_reason == "stop"
    shown = []
    result = generate_streaming(generator, prompt, generator.options(max_length=96), shown.append, stop=stop)
    assert "".join(shown) == result.text == stopped.text
    assert generator.last_stats.speculation.accepted > 0


# --- structured output -------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "flag": {"type": "boolean"}},
          "required": ["name", "flag"], "additionalProperties": False}


@pytest.mark.parametrize("grammar", [
    dict(guided_json=SCHEMA),
    dict(guided_choice=["yes", "no", "yes and no, and yes again"]),
    dict(guided_regex=r"[a-z ]{4,30}\."),
], ids=["json_schema", "choice", "regex"])
def test_grammar_greedy_equals_the_plain_loop(monkeypatch, seed7_checkpoint, grammar):
    """The mask applies at every verified position: guesses the grammar refuses are rejected, a
    grammar that ends inside a pass ends the row there ("stop"), and the tokens are the plain
    loop's with the same grammar."""
    generator = Generator.from_pretrained(seed7_checkpoint)
    options = dict(max_length=48, ignore_eos=False, **grammar)
    plain = generator.generate(PROMPTS, **options)
    assert any(r.finish_reason == "stop" for r in plain)  # a grammar ended some row
    # Each row as it is alone (a finished row's pads, fed to its grammar while others ran, once
    # ended its grammar and lengthened its tokens).
    assert outcome(plain) == [outcome(generator.generate(p, **options))[0] for p in PROMPTS]
    use_guesser(monkeypatch, oracle(generator, PROMPTS, [r.token_ids for r in plain]))
    ours = generator.generate(PROMPTS, speculate="ngram:4", **options)
    assert outcome(ours) == outcome(plain)
    stats = generator.last_stats.speculation
    assert 0 < stats.accepted < stats.offered and stats.tokens_per_verify > 1.5
    if "guided_json" in grammar:
        for r in ours:
            if r.finish_reason == "stop":
                assert set(json.loads(r.text)) == {"name", "flag"}


def test_grammar_sampling_without_guesses_is_the_plain_sampler(monkeypatch, seed7_checkpoint):
    generator = Generator.from_pretrained(seed7_checkpoint)
    options = dict(max_length=40, do_sample=True, seed=5, temperature=0.8, guided_json=SCHEMA)
    plain = generator.generate(PROMPTS, **options)
    use_guesser(monkeypatch, lambda sequence, used, k: (torch.zeros(len(used), k, dtype=torch.long),
                                                       torch.zeros_like(used)))
    assert outcome(generator.generate(PROMPTS, speculate="ngram:4", **options)) == outcome(plain)
    # With guesses: other draws (the same distribution), still within the grammar, and seeded.
    use_guesser(monkeypatch, oracle(generator, PROMPTS, [r.token_ids for r in plain]))
    first = generator.generate(PROMPTS, speculate="ngram:4", **options)
    assert generator.last_stats.speculation.accepted > 0
    assert outcome(generator.generate(PROMPTS, speculate="ngram:4", **options)) == outcome(first)
    for r in first:
        if r.finish_reason == "stop":
            assert set(json.loads(r.text)) == {"name", "flag"}


def test_a_budget_that_ends_just_before_eos_ends_with_length(monkeypatch, eos_generator):
    """Each row's budget one short of its EOS, every guess right (the EOS among them): the row
    ends at its budget with "length", as in the plain loop. (The loop offers no guess past a
    row's budget; the end reasons are decided after the budget's cut all the same, so an offer
    past it could not turn "length" into "eos".)"""
    ended = [r for r in eos_generator.generate(PROMPTS, max_length=36, ignore_eos=False)]
    budgets = [max(1, len(r.token_ids) - 1) if r.finish_reason == "eos" else 30 for r in ended]
    assert any(r.finish_reason == "eos" and len(r.token_ids) > 2 for r in ended)
    options = dict(max_length=36, ignore_eos=False, max_new_tokens_each=budgets)
    plain = eos_generator.generate(PROMPTS, **options)
    use_guesser(monkeypatch, oracle(eos_generator, PROMPTS, [r.token_ids for r in ended], wrong_every=0))
    ours = eos_generator.generate(PROMPTS, speculate="ngram:8", **options)
    assert outcome(ours) == outcome(plain)
    assert eos_generator.last_stats.speculation.accepted > 0


# --- weights: LoRA, int4; the prefix cache -----------------------------------------------------------


def test_a_merged_lora_adapter(monkeypatch, seed7_checkpoint, tmp_path):
    from lora_adapters import make_adapter, peft_reference

    adapter = make_adapter(seed7_checkpoint, tmp_path / "adapter", seed=3, r=4, lora_alpha=8,
                           target_modules=["query_key_value", "dense_h_to_4h"])
    generator = Generator.from_pretrained(seed7_checkpoint, peft_weights=adapter)
    options = dict(max_length=32)
    plain = ids_of(generator.generate(PROMPTS, **options))
    reference = peft_reference(seed7_checkpoint, adapter)
    for ids, prompt in zip(plain, PROMPTS):
        assert ids[0] == hf_greedy(reference, generator.tokenizer.encode(prompt), 32)
    use_guesser(monkeypatch, oracle(generator, PROMPTS, [p[0] for p in plain]))
    assert ids_of(generator.generate(PROMPTS, speculate="ngram:4", **options)) == plain
    assert generator.last_stats.speculation.accepted > 0


def test_int4_weights(tiny_checkpoint):
    generator = Generator.from_pretrained(tiny_checkpoint, quantize="int4")
    plain = ids_of(generator.generate(REPEATING, max_length=64))
    assert ids_of(generator.generate(REPEATING, max_length=64, speculate="ngram:4")) == plain
    assert generator.last_stats.speculation.accepted > 0


def test_prefix_cache_hits(tiny_checkpoint):
    """A conversation's next turns with the prefix cache: the blocks of the first call's prompt and
    output (stored after a speculating loop) serve the second call's prompt, the second's the
    third's; the tokens are those without speculation and without the cache."""
    plain = Generator.from_pretrained(tiny_checkpoint)
    generator = Generator.from_pretrained(tiny_checkpoint, prefix_cache="16MB", speculate="ngram:4")
    prompts = REPEATING
    for turn in range(3):
        results = generator.generate(prompts, max_length=64 * (turn + 1))
        assert ids_of(results) == ids_of(plain.generate(prompts, max_length=64 * (turn + 1)))
        assert generator.last_stats.speculation.accepted > 0
        assert (generator.last_stats.cached_tokens >= 32) == (turn > 0)  # whole blocks of 32 tokens
        prompts = [p + r.text + " And" for p, r in zip(prompts, results)]


# --- the CLI: --requests, --chat, beams ----------------------------------------------------------------


def write_requests(path: Path) -> Path:
    lines = [
        {"prompt": REPEATING[0], "max_tokens": 40},
        {"prompt": REPEATING[1], "max_tokens": 30, "stop": ["earth"], "logprobs": 2},
        {"prompt": [REPEATING[0], "It was the best of times"], "max_tokens": 24, "echo": True},
        {"prompt": "And the LORD", "max_tokens": 20,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    ]
    # Greedy (a request samples unless its temperature is 0): the same tokens, not only the same distribution.
    path.write_text("".join(json.dumps({**line, "temperature": 0}) + "\n" for line in lines))
    return path


def test_requests_results_equal_those_without_speculation(tiny_checkpoint, tmp_path, capsys):
    requests = write_requests(tmp_path / "requests.jsonl")
    records = {}
    for name, extra in (("plain", []), ("speculating", ["--speculate", "ngram:4"])):
        results = tmp_path / f"{name}.jsonl"
        assert bloom.main(["--weights", str(tiny_checkpoint), "--requests", str(requests), "--results", str(results),
                           *extra]) == 0
        summary = capsys.readouterr().err.strip().splitlines()[-1]
        records[name] = [json.loads(line) for line in results.read_text().splitlines()]
        for record in records[name]:
            del record["result"]["request_time"]
        if extra:
            assert "4 requests answered" in summary and "tokens/verify, acceptance" in summary
            verify = float(summary.split("speculation: ")[1].split(" tokens/verify")[0])
            assert verify > 1.0  # guesses were accepted
        else:
            assert "speculation" not in summary
    assert records["speculating"] == records["plain"]
    assert any(c["finish_reason"] == "stop" for r in records["plain"] for c in r["result"]["choices"])


def test_a_beam_request_is_refused_on_its_line(tiny_checkpoint, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "And God said", "max_tokens": 8, "num_beams": 2}) + "\n"
                        + json.dumps({"prompt": "And God said", "max_tokens": 8, "temperature": 0}) + "\n")
    results = tmp_path / "results.jsonl"
    assert bloom.main(["--weights", str(tiny_checkpoint), "--requests", str(requests), "--results", str(results),
                       "--speculate", "ngram"]) == 1
    errors = [json.loads(line) for line in (tmp_path / "results.jsonl.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["error"]) for e in errors] == [
        (1, "speculative decoding (ngram:4) works with greedy search and sampling, not with beam search (num_beams > 1)")]
    assert len(results.read_text().splitlines()) == 1 and "Traceback" not in capsys.readouterr().err


def test_chat_replies_equal_those_without_speculation(tiny_checkpoint, monkeypatch, capsys):
    """``--chat --speculate``: the shell, fed lines on stdin, replies as without speculation."""
    lines = "In the beginning God created the heaven\nAnd God said\n/raw_prompt\n"
    shown = {}
    for name, extra in (("plain", []), ("speculating", ["--speculate", "ngram:4"])):
        monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
        assert bloom.main(["--chat", "--weights", str(tiny_checkpoint), "--sample", "f", "--max_tokens", "40",
                           "--max_length", "256", *extra]) == 0
        shown[name] = capsys.readouterr().out
    assert shown["speculating"] == shown["plain"]
    assert shown["plain"].count("<bot>:") >= 2  # /raw_prompt showed both replies


def test_stream_prints_the_text_without_speculation(tiny_checkpoint, capsys):
    shown = {}
    for name, extra in (("plain", []), ("speculating", ["--speculate", "ngram:4"])):
        assert bloom.main(["--weights", str(tiny_checkpoint), "--stream", "--max_length", "80", *extra, *REPEATING]) == 0
        shown[name] = capsys.readouterr().out
    assert shown["speculating"] == shown["plain"] and REPEATING[1] in shown["plain"]


def test_beams_are_refused_in_one_line(tiny_checkpoint, capsys):
    assert bloom.main(["--weights", str(tiny_checkpoint), "--speculate", "ngram", "--options", "num_beams=2", "x"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not with beam search" in errors[0] and "Traceback" not in err


def test_cli_refuses_eval_in_one_line(tmp_path, capsys):
    assert bloom.main(["--speculate", "ngram", "--eval", str(tmp_path / "x.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "not with --eval" in err and "Traceback" not in err


# --- two tensor-parallel ranks -----------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_speculating_give_one_process_tokens(tiny_checkpoint, tmp_path):
    """``deepspeed --num_gpus 2 bloom.py --speculate ngram:4``: the tokens of one process without
    speculation (every rank guesses alike and accepts alike), guesses accepted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               str(ROOT / "bloom.py"), "--weights", str(tiny_checkpoint), "--device", "cpu", "--speculate", "ngram:4",
               "--max_length", "64", "--output_file", str(out), *REPEATING]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    want = ids_of(Generator.from_pretrained(tiny_checkpoint).generate(REPEATING, max_length=64))
    assert [[r["token_ids"]] for r in json.loads(out.read_text())] == want
    verify = float(log.split("speculation: ")[1].split(" tokens/verify")[0])
    assert verify > 1.5
