"""Bad input of every kind gets one `error:` line and exit 1 (or, in a request file, an error record
for its line while the other lines are answered); checked before any work or memory is taken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import bloom
from bloom_hpu.checkpoint import CheckpointError
from generation.generator import Generator
from generation.jobs import runner
from generation.jobs.runner import run_requests
from generation.request.memory import MemoryCheckError
from generation.request.options import OptionError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "bloom-tiny"  # vocabulary of 2048, 4 heads


def cli(argv, capsys) -> tuple[int, str]:
    code = bloom.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1, err
    return code, lines[0]


@pytest.fixture(scope="module")
def gen():
    return Generator.from_pretrained(TINY, device="cpu")


# --- the command line -----------------------------------------------------------------------------

CLI_CASES = [
    (["--options", "num_beams=1025", "Hello"], "num_beams must be at most 1024"),
    (["--options", "top_k=5000", "Hello"], "top_k"),
    (["--options", "do_sample,temperature=1e-45", "Hello"], "temperature"),
    (["--options", "do_sample,temperature=inf", "Hello"], "finite"),
    (["--options", "length_penalty=nan", "Hello"], "finite"),
    (["--options", "length_penalty=-inf", "Hello"], "finite"),
    (["ab\udcff\udcfe"], "not UTF-8"),
    (["--requests", "{req}", "--results", "{out}", "Hello"], "cannot be used with it"),
    (["--requests", "{req}", "--results", "{out}", "--eval", "{req}"], "one at a time"),
    (["--requests", "{req}", "--results", "{out}", "--budget", "-5"], "--budget"),
    (["--model", "bloom-560m", "Hello"], "bloom-560m not found"),
    (["--max_length", "1000000000", "Hello"], "lower --batch_size, --max_length"),
    (["--mode", "vanilla", "--max_length", "1000000000", "Hello"], "memory"),
    (["--serve", "--max_batch", "4096", "--max_length", "100000"], "lower --max_batch, --max_prefill, --max_length or --bucket_width"),
    (["--serve", "--max_prefill", "0"], "--max_prefill"),
    (["--serve", "--prefill_chunk", "0"], "--prefill_chunk"),
    (["--serve", "--burst_wait_ms", "-1"], "--burst_wait_ms must be between 0 and 1000"),
    (["--input_file", "{obj}"], "JSON object"),
    (["--eval", "{surrogate}"], "lone surrogate"),
    (["--eval", "{deep}"], "nested too deeply"),
]


@pytest.mark.parametrize("argv, message", CLI_CASES, ids=[m for _, m in CLI_CASES])
def test_bad_command_lines_get_one_clear_line(tmp_path, capsys, argv, message):
    req, obj = tmp_path / "in.jsonl", tmp_path / "obj.json"
    req.write_text('{"prompt": "Hi"}\n')
    obj.write_text('{"prompt": "a"}')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "a b \\ud800"}\n')
    (tmp_path / "deep.jsonl").write_text("[" * 100000 + "]" * 100000 + "\n")
    argv = [a.format(req=req, out=tmp_path / "out.jsonl", obj=obj, surrogate=tmp_path / "surrogate.jsonl",
                     deep=tmp_path / "deep.jsonl") for a in argv]
    _, line = cli(argv, capsys)
    assert message in line, line


def test_the_memory_refusal_names_the_numbers(capsys, monkeypatch):
    # As on a machine with 4 GiB free, whatever this one has: 10 million slots of the tiny model's
    # cache need ~30 GiB.
    monkeypatch.setattr("generation.request.memory.free_bytes", lambda device: 4 << 30)
    _, line = cli(["--max_length", "10000000", "Hello"], capsys)
    assert "GiB" in line and "4.0 GiB is free" in line and "lower" in line


def test_a_bom_prefixed_list_is_a_list(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_bytes(b'\xef\xbb\xbf["Hello", "World"]')
    assert bloom.main(["--max_length", "8", "--quiet", "--input_file", str(prompts)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_every_prompt_is_checked_before_the_first_batch(capsys):
    code, line = cli(["--max_length", "8", "Hi", "Ho", "a b c d e f g h i j k l m n o p"], capsys)
    assert "prompt 3" in line and "batch 1" not in capsys.readouterr().out


def test_every_returned_sequence_is_printed(capsys):
    assert bloom.main(["--max_length", "8", "--options", "do_sample,num_return_sequences=3,seed=1", "Hi"]) == 0
    out = capsys.readouterr().out
    assert "output 1:" in out and "output 3:" in out


# --- checkpoints ----------------------------------------------------------------------------------

CONFIGS = [
    ([], "must hold a JSON object"),
    ({"n_layer": "3"}, "n_layer must be an integer"),
    ({"n_head": 0}, "n_head must be between"),
    ({"vocab_size": -1}, "vocab_size must be between"),
    ({"model_type": "gpt2"}, "BLOOM models only"),
    ({"hidden_size": 126}, "not a multiple of n_head"),
    ({"eos_token_id": 5000}, "outside the vocabulary"),
]


@pytest.mark.parametrize("change, message", CONFIGS, ids=[m for _, m in CONFIGS])
def test_a_broken_config_is_named(tmp_path, capsys, change, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change if isinstance(change, list) else {**config, **change}))
    _, line = cli(["--weights", folder, "Hello"], capsys)
    assert message in line and "config.json" in line


def test_a_broken_tokenizer_is_named(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(TINY, folder)
    (folder / "tokenizer.json").write_text('{"model": 3}')
    _, line = cli(["--weights", folder, "Hello"], capsys)
    assert "tokenizer" in line


# --- the library ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"prompts": None}, "prompts"), ({"prompts": ["a", 3]}, "prompts[1]"), ({"options": 42}, "options"),
    ({"max_new_tokens_each": 5}, "max_new_tokens_each"), ({"on_step": 1}, "on_step"),
])
def test_library_argument_types_are_named_at_the_call(gen, kwargs, name):
    kwargs = {"prompts": ["Hello"], **kwargs}
    with pytest.raises(TypeError, match=name.replace("[", r"\[")):
        gen.generate(**kwargs)


def test_library_refuses_what_the_model_cannot_do(gen):
    with pytest.raises(OptionError, match="num_beams"):
        gen.generate(["Hello"], num_beams=1025, max_length=8)
    with pytest.raises(OptionError, match="num_beams"):
        gen.stream("Hello", num_beams=1025, max_length=8)
    with pytest.raises(MemoryCheckError, match="max_length"):
        gen.generate(["Hello"], max_length=10**9)
    with pytest.raises(ValueError, match="dtype"):
        Generator.from_pretrained(TINY, dtype=torch.int8)
    with pytest.raises(CheckpointError):
        Generator.from_pretrained(TINY / "nope")


# --- request files --------------------------------------------------------------------------------

GOOD = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0}
POISONED = [
    '{"prompt": "a", "num_beams": 1100, "temperature": 0}',
    '{"prompt": "a", "max_tokens": 1e400}',
    '{"prompt": "a", "max_tokens": 1000000000}',
    '{"prompt": "a", "n": 100000}',
    '{"prompt": "\\ud800"}',
    '[' * 100000 + ']' * 100000,
    '{"prompt": "a", "max_tokens": NaN}',
    '{"prompt": "a", "temperature": NaN}',
    '{"prompt": "a", "min_new_tokens": "3"}',
    '{"prompt": "a", "top_k": 99999}',
]


def test_poisoned_lines_get_error_records_and_good_lines_are_answered(gen, tmp_path):
    lines = []
    for bad in POISONED:
        lines += [bad, json.dumps({**GOOD, "prompt": f"good {len(lines)}"})]
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = "\n".join(lines).encode() + b'\n{"prompt": "caf\xe9"}\n' + json.dumps(GOOD).encode() + b"\n"
    requests.write_bytes(data)
    summary = run_requests(gen, requests, results, budget=256, progress=False)
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert sorted(e["line"] for e in errors) == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21]
    assert all(e["error"] for e in errors)
    assert summary.answered == len(POISONED) + 1 and summary.errors == len(errors)
    assert requests.read_bytes() == data


def test_a_request_that_fails_while_answered_costs_only_its_own_line(gen, tmp_path, monkeypatch):
    real = runner.answer_batch

    def fragile(generator, batch):
        if any(r.prompts == ["boom"] for r in batch.requests):
            raise RuntimeError("selected index k out of range")
        return real(generator, batch)

    monkeypatch.setattr(runner, "answer_batch", fragile)
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text("".join(json.dumps({**GOOD, "prompt": p}) + "\n" for p in ["one", "boom", "two"]))
    summary = run_requests(gen, requests, results, budget=8192, progress=False)
    assert summary.answered == 2 and summary.errors == 1
    error = json.loads((tmp_path / "out.jsonl.errors.jsonl").read_text())
    assert error["line"] == 2 and "RuntimeError" in error["error"]


def test_a_prompt_of_token_ids_is_the_text_it_encodes_and_bad_ids_are_named(gen):
    ids = gen.tokenizer.encode("It was the best of times")
    by_ids, by_text = gen.generate([ids, "It was the best of times"], max_new_tokens=6, ignore_eos=True)
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt == "It was the best of times"
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a string or a non-empty list of token ids.*\[\[id"):
        gen.generate(ids, max_new_tokens=2)  # a flat list of ids: which prompt was meant?
    with pytest.raises(ValueError, match=r"prompts\[1\]: token id 2048 is outside the model's vocabulary \(0..2047\)"):
        gen.generate([ids, [5, 2048]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids are at least 0"):
        gen.generate([[5, -1]], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a string or a non-empty list"):
        gen.generate([[]], max_new_tokens=2)
