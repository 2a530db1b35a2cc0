"""Progress on stderr (generation/run/progress.py): tqdm's live bar on a terminal, plain occasional lines
anywhere else, nothing when turned off; and the CLI's evaluation and warm-up through it."""

from __future__ import annotations

import io
import json

import bloom
from generation.run import progress
from generation.run.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_lines_are_plain_and_show_rates():
    out = io.StringIO()
    with Progress(10, "requests", "requests", stream=out, every=0) as bar:
        bar.update(4, "100.0 tokens/s")
        bar.update(6, "120.0 tokens/s")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split()[:3] for line in lines] == [["requests:", "4/10", "(40%)"], ["requests:", "10/10", "(100%)"]]
    assert "requests/s" in lines[0] and lines[0].endswith("100.0 tokens/s]")


def test_off_a_terminal_short_work_prints_nothing_and_long_work_ends_with_a_line():
    out = io.StringIO()
    with Progress(3, "warm-up", "shapes", stream=out) as bar:  # every 30 s: never reached here
        bar.update(3)
    assert out.getvalue() == ""
    with Progress(3, "warm-up", "shapes", stream=out, every=0) as bar:
        bar.update(1)
        bar.every = 3600.0  # the rest comes sooner than the next line: close says where it ended
        bar.update(2)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["1/3", "3/3"]


def test_a_terminal_gets_the_live_tqdm_bar():
    out = Terminal()
    with Progress(10, "eval", "passages", stream=out) as bar:
        bar.update(4)
    assert "\r" in out.getvalue() and "4/10" in out.getvalue() and "passages/s" in out.getvalue()


def test_turned_off_prints_nothing_even_on_a_terminal():
    out = Terminal()
    with Progress(10, "eval", "passages", stream=out, enabled=False, every=0) as bar:
        bar.update(4)
    assert out.getvalue() == ""


def test_cli_eval_and_warmup_show_progress_unless_quiet(scoring_setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)
    folder = scoring_setup[0]
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": f"the {w} sat on the {w}"}) + "\n" for w in ("cat", "dog", "cow")))
    assert bloom.main(["--weights", str(folder), "--eval", str(data)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "eval: 3/3 (100%)" in err and "passages/s" in err

    warm = ["--weights", str(folder), "--max_length", "24", "--options", "bucket_width=8", "--warmup", "Hello"]
    assert bloom.main(warm) == 0
    err = capsys.readouterr().err
    # 3 prefill and 3 decode shapes, and the prefix cache's extend of a rest of 16 (the CLI has one)
    assert "\r" not in err and "warm-up: 7/7 (100%)" in err and "shapes/s" in err
    assert bloom.main(warm + ["--quiet"]) == 0
    assert "warm-up: 6/6" not in capsys.readouterr().err


def test_a_long_generate_call_counts_its_steps_on_stderr(tiny_checkpoint, capsys, monkeypatch):
    """What the CLI passes for every batch (progress=True): a call that runs for a while counts its
    steps on stderr (plain lines here, where stderr is not a terminal; every LINE_EVERY seconds, cut
    short for the test); a quick one prints nothing."""
    import generation.run.progress as progress
    from generation.generator import Generator

    generator = Generator.from_pretrained(tiny_checkpoint)
    generator.generate("Hello", max_length=12, progress=True)
    assert "generating" not in capsys.readouterr().err
    monkeypatch.setattr(progress, "LINE_EVERY", 0.05)
    generator.generate("Hello", max_length=64, do_sample=True, num_return_sequences=400, seed=1, progress=True)
    err = capsys.readouterr().err
    assert "generating:" in err and "steps" in err, err
    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)  # a line at every step
    generator.generate("Hello", max_length=24, num_beams=4, progress=True)  # beam search counts its steps too
    assert "generating: 21/21" in capsys.readouterr().err  # the tokenizer makes "Hello" 3 tokens
