"""The CLI end to end: the embedded default, a saved checkpoint, files in and out, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bloom
from generation.generator import Generator
from utils.random_checkpoint import make_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "bloom.py"), *args], capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A weights folder holding one model, as utils/fetch_weights.py lays it out."""
    root = tmp_path_factory.mktemp("weights")
    make_random_checkpoint(root / "bloom-test", hidden_size=64, n_layer=2, n_head=4, seed=11)
    return root


def test_embedded_default_runs_offline():
    result = run_cli("--max_length", "24", "It was the best of times")
    assert result.returncode == 0, result.stderr
    assert "embedded default checkpoint" in result.stderr
    assert "prompt: 'It was the best of times'" in result.stdout
    assert "graphs: 2" in result.stdout  # one prefill + one decode shape
    assert "Traceback" not in result.stderr


def test_saved_checkpoint_outputs_match_the_library(weights, tmp_path):
    prompts = ["It was the best of times", "Hello", "The quick brown fox jumps"]
    (tmp_path / "in.json").write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    result = run_cli("--weights", str(weights), "--model", "bloom-test", "--max_length", "20", "--batch_size", "2",
                     "--input_file", str(tmp_path / "in.json"), "--output_file", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("batch ") == 2  # 3 prompts in batches of 2
    records = json.loads(out.read_text())
    expected = Generator.from_pretrained(weights, "bloom-test").generate(prompts, max_length=20)
    assert [r["prompt"] for r in records] == prompts
    for record, want in zip(records, expected):
        assert record["completion"] == want.text
        assert record["token_ids"] == want.token_ids
        assert record["finish_reason"] == "length"


def test_vanilla_mode_gives_the_same_tokens(weights, tmp_path, capsys):
    outs = {}
    for mode in ("optimized", "vanilla"):
        path = tmp_path / f"{mode}.json"
        code = bloom.main(["--weights", str(weights), "--model", "bloom-test", "--max_length", "24", "--mode", mode,
                           "--batch_size", "3", "--output_file", str(path), "Hello", "a b c", "It was the best of"])
        assert code == 0
        outs[mode] = [r["token_ids"] for r in json.loads(path.read_text())]
    assert outs["optimized"] == outs["vanilla"]


def test_text_input_file_one_prompt_per_line(weights, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("first prompt\n\nsecond prompt\n")
    code = bloom.main(["--weights", str(weights / "bloom-test"), "--max_length", "12", "--quiet",
                       "--input_file", str(tmp_path / "in.txt")])
    assert code == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


BAD_INPUTS = [
    (["--weights", "/nonexistent/folder", "hi"], "does not exist"),
    (["--weights", "{weights}", "--model", "bloom-nope", "hi"], "bloom-nope"),
    (["--weights", "{weights}", "--model", "bloom-test", "--max_length", "4", "It was the best of times"],
     "raise --max_length"),
    (["--max_length", "0", "hi"], "max_length must be >= 1"),
    ([], "no prompts"),
    (["--input_file", "/nonexistent/prompts.json"], "does not exist"),
    (["--input_file", "{malformed}"], "not valid JSON"),
    (["--device", "cuda", "hi"], "no CUDA device"),
    (["--options", "top_p=1.5", "hi"], "top_p"),
    (["--options", "num_beams=0", "hi"], "num_beams"),
    (["--options", "bogus=1", "hi"], "unknown option 'bogus'"),
    (["--options", "max_length=abc", "hi"], "max_length expects int"),
    (["--batch_size", "0", "hi"], "batch_size"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_gets_one_clear_line(weights, tmp_path, capsys, argv, message):
    malformed = tmp_path / "bad.json"
    malformed.write_text('["unterminated", \n')
    argv = [a.format(weights=weights, malformed=malformed) for a in argv]
    code = bloom.main(argv)
    err = capsys.readouterr().err
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_incomplete_weights_folder_lists_what_is_missing(weights, tmp_path, capsys):
    broken = tmp_path / "bloom-broken"
    broken.mkdir()
    (broken / "config.json").write_text((weights / "bloom-test" / "config.json").read_text())
    code = bloom.main(["--weights", str(tmp_path), "--model", "bloom-broken", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "tokenizer.json" in err and "fetch_weights.py" in err


def test_bad_input_in_a_real_process_exits_nonzero_without_traceback():
    result = run_cli("--weights", "/nonexistent/folder", "hi")
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and "Traceback" not in result.stderr
