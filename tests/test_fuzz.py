"""A seeded fuzz of bad input: command lines, checkpoint folders, request lines and file paths.

Every case is built to be wrong in at least one way, and must end with a non-zero exit (or, for a
request line, an error record) and no traceback; input files stay byte for byte as they were, and
a good request line after a bad one is still answered. Everything runs in-process on the embedded
tiny checkpoint, so the few hundred cases take seconds.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

import bloom
from generation.generator import Generator
from generation.jobs.runner import run_requests

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "bloom-tiny"
SEED = 15


def call(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = bloom.main(argv)
    except SystemExit as exit_:  # argparse's own usage errors: a usage line and status 2
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, (argv, err)
    return code, err


# --- command lines ------------------------------------------------------------------------------

BAD_FLAGS = [
    ["--max_length", "0"], ["--max_length", "-7"], ["--max_length", "1000000000"], ["--max_length", "x"],
    ["--batch_size", "0"], ["--batch_size", "-1"], ["--dtype", "int8"], ["--device", "tpu"],
    ["--device", "cuda"], ["--mode", "fast"], ["--seed", "-1"], ["--ignore_eos", "maybe"],
    ["--budget", "-5"], ["--weights", "/nonexistent/weights"], ["--model", "bloom-nope"],
    ["--input_file", "/nonexistent/p.txt"], ["--cpu_path", "avx9"], ["--use_graphs", "2"],
]
BAD_OPTIONS = [
    "num_beams=1025", "num_beams=0", "top_k=5000", "top_k=-1", "top_p=0", "top_p=1.5", "top_p=nan",
    "do_sample,temperature=1e-45", "do_sample,temperature=inf", "temperature=-1", "length_penalty=nan",
    "length_penalty=-inf", "repetition_penalty=0", "repetition_penalty=inf", "num_return_sequences=3",
    "max_new_tokens=0", "min_new_tokens=-1", "seed=-3", "bogus=1", "max_length=abc", "max_length:str=3",
    "no_repeat_ngram_size=-2", "bucket_width=-1", "max_length=1e400", "max_length=99999999999999",
    "x:complex=1", "early_stopping=sometimes",
]
BAD_PROMPTS = ["ab\udcff\udcfe", "\ud800", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3]


def bad_command_line(rng: random.Random, tmp: Path) -> list[str]:
    argv = ["--max_length", "16", "--quiet"]
    kind = rng.randrange(4)
    if kind == 0:
        argv += rng.choice(BAD_FLAGS)
    elif kind == 1:
        argv += ["--options", ",".join(rng.sample(BAD_OPTIONS, rng.randint(1, 2)))]
    elif kind == 2:
        argv += ["Hello"] * rng.randint(0, 2) + [rng.choice(BAD_PROMPTS)]
    else:  # flags that contradict each other
        argv += rng.choice([
            ["--requests", str(tmp / "in.jsonl"), "--results", str(tmp / "r.jsonl"), "Hello"],
            ["--requests", str(tmp / "in.jsonl"), "--results", str(tmp / "r.jsonl"), "--eval", str(tmp / "in.jsonl")],
            ["--requests", str(tmp / "in.jsonl")],
            ["--results", str(tmp / "r.jsonl"), "Hello"],
            ["--errors", str(tmp / "e.jsonl"), "Hello"],
            ["--requests", str(tmp / "in.jsonl"), "--results", str(tmp / "r.jsonl"), "--stream"],
        ])
    if rng.random() < 0.3:
        argv.append("Hello")  # a good prompt in the mix changes nothing
    return argv


def test_bad_command_lines(tmp_path, capsys):
    rng = random.Random(SEED)
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi", "max_tokens": 1, "temperature": 0}\n')
    before = (tmp_path / "in.jsonl").read_bytes()
    for _ in range(150):
        argv = bad_command_line(rng, tmp_path)
        code, err = call(argv, capsys)
        assert code not in (0, None), (argv, err)
        assert err.strip(), argv
    assert (tmp_path / "in.jsonl").read_bytes() == before


# --- checkpoint folders ---------------------------------------------------------------------------

BAD_CONFIG_VALUES = ["3", -1, 0, 1.5, None, True, [], {}, 10**30, "bloom"]
CONFIG_KEYS = ["vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon", "eos_token_id",
               "apply_residual_connection_post_layernorm"]


def broken_checkpoint(rng: random.Random, folder: Path) -> None:
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        os.symlink(TINY / name, folder / name)  # shared, read-only: only what is broken is copied
    config = json.loads((TINY / "config.json").read_text())
    kind = rng.randrange(5)
    if kind == 0:
        key, value = rng.choice(CONFIG_KEYS), rng.choice(BAD_CONFIG_VALUES)
        if value is None:
            config.pop(key, None)  # a missing field
        else:
            config[key] = value
        text = json.dumps(config)
    elif kind == 1:
        text = rng.choice(["[]", "{", "null", '"bloom"', json.dumps({**config, "model_type": "gpt2"}), "\xff"])
    elif kind == 2:
        text = json.dumps(config)
        (folder / "tokenizer.json").unlink()
        (folder / "tokenizer.json").write_text(rng.choice(["", "{", '{"model": 3}', "[]", "null"]))
    elif kind == 3:
        text = json.dumps(config)
        (folder / "model.safetensors").unlink()
        data = (TINY / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: rng.randrange(len(data) // 2)])
    else:
        text = json.dumps({**config, "hidden_size": 100})  # not a multiple of n_head, or a shape mismatch
    (folder / "config.json").write_text(text)


def test_broken_checkpoint_folders(tmp_path, capsys):
    rng = random.Random(SEED + 1)
    for i in range(40):
        folder = tmp_path / f"ckpt{i}"
        broken_checkpoint(rng, folder)
        config = (folder / "config.json").read_bytes()
        code, err = call(["--weights", str(folder), "--max_length", "8", "--quiet", "Hello"], capsys)
        if code == 0:  # a mutation that happens to be harmless (e.g. an unused key) must run cleanly
            assert json.loads(config) is not None
            continue
        assert code == 1 and err.count("error:") == 1, (config, err)


# --- request lines ------------------------------------------------------------------------------

GOOD = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
BAD_FIELDS = {
    "prompt": [None, 3, [], [3], "", [""], {"a": 1}, "\ud800", ["a", "\udfff"]],
    "max_tokens": [-1, 1.5, "4", 1e400, 10**12, 1000000000, True, [1]],
    "temperature": [-1, "hot", [0], 1e400, True],
    "top_p": [0, 2, "x", -1e400],
    "n": [0, -1, 100000, 1.5, "2"],
    "best_of": [0, 100000, "3"],
    "logprobs": [-1, 6, "2", 1e400],
    "echo": ["yes", 1],
    "stop": [3, [3], [""], {"a": 1}],
    "seed": [-1, "1", 1.5, 2**70],
    "num_beams": [0, 600, "2", 1.5],
    "top_k": [-1, 99999, "3"],
    "min_new_tokens": ["3", -1, 1e400],
    "repetition_penalty": [0, "x", -1],
    "length_penalty": ["x", True],
    "no_repeat_ngram_size": [-1, "2"],
    "early_stopping": ["sometimes", 3],
    "bogus_key": [1],
    "logit_bias": [{"1": 5}],
}
RAW_BAD_LINES = [
    b"{", b"[]", b"null", b"3", b'{"prompt": "a", "max_tokens": NaN}', b'{"prompt": "a", "temperature": Infinity}',
    b'{"prompt": "caf\xe9"}', b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}",
]


def bad_request_line(rng: random.Random) -> bytes:
    if rng.random() < 0.2:
        return rng.choice(RAW_BAD_LINES)
    request = dict(GOOD)
    for key in rng.sample(sorted(BAD_FIELDS), rng.randint(1, 2)):
        request[key] = rng.choice(BAD_FIELDS[key])
    if request.get("max_tokens") == 0 and not request.get("echo"):
        request["max_tokens"] = -1
    return json.dumps(request).encode()


@pytest.fixture(scope="module")
def tiny():
    return Generator.from_pretrained(TINY, device="cpu")


def test_bad_request_lines_never_stop_the_job(tiny, tmp_path):
    rng = random.Random(SEED + 2)
    lines, good_lines = [], []
    for i in range(120):
        lines.append(bad_request_line(rng))
        lines.append(json.dumps({**GOOD, "prompt": f"good {i}"}).encode())
        good_lines.append(len(lines))
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = b"\n".join(lines) + b"\n"
    requests.write_bytes(data)
    summary = run_requests(tiny, requests, results, budget=4096, progress=False)
    answered = [json.loads(line)["request"]["prompt"] for line in results.read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert requests.read_bytes() == data
    assert {f"good {i}" for i in range(120)} <= set(answered)
    bad_lines = {n for n in range(1, len(lines) + 1) if n not in good_lines}
    # Every bad line is refused (a mutation that happens to be valid, e.g. a tolerated value, is
    # answered instead: it must then be in the results, not lost).
    refused = {e["line"] for e in errors}
    assert refused <= bad_lines and all(e["error"] for e in errors)
    assert summary.errors == len(errors) and summary.answered == len(answered)
    assert len(refused) + (len(answered) - 120) == len(bad_lines)


# --- file paths -----------------------------------------------------------------------------------


def test_file_path_combinations_never_damage_an_input(tmp_path, capsys):
    rng = random.Random(SEED + 3)
    prompts, requests = tmp_path / "prompts.txt", tmp_path / "in.jsonl"
    prompts.write_text("Hello\n")
    requests.write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "link_prompts").symlink_to(prompts)
    (tmp_path / "link_requests").symlink_to(requests)
    os.link(requests, tmp_path / "hard_requests")
    (tmp_path / "folder").mkdir()
    originals = {p: p.read_bytes() for p in (prompts, requests)}
    same_prompts = [str(prompts), str(tmp_path / "link_prompts")]
    same_requests = [str(requests), str(tmp_path / "link_requests"), str(tmp_path / "hard_requests")]
    elsewhere = [str(tmp_path / "folder"), str(tmp_path / "missing" / "x.json")]
    for i in range(60):
        fresh = str(tmp_path / f"out{i}.json")
        if rng.random() < 0.5:
            output = rng.choice(same_prompts + elsewhere + [fresh])
            argv = ["--input_file", rng.choice(same_prompts), "--output_file", output]
            colliding = output in same_prompts
        else:
            results = rng.choice(same_requests + elsewhere + [fresh])
            errors = rng.choice(same_requests + [results, fresh + ".errors"])
            argv = ["--requests", str(requests), "--results", results, "--errors", errors]
            colliding = results in same_requests or errors in same_requests or errors == results
        code, err = call(["--max_length", "8", "--quiet", *argv], capsys)
        if colliding:
            assert code == 1 and "same file" in err, (argv, err)
        for path, data in originals.items():
            assert path.read_bytes() == data, argv
        assert not list(tmp_path.glob(".*.tmp")), argv  # no temporary file left behind
