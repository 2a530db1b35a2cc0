"""Files are sacred: no output may clobber an input, links and FIFOs stay what they are, a full disk
is reported, results files are repaired rather than cut, one run per results file, and a batch is
saved before it is printed. Every path is made in a temporary folder (never the machine's own
/dev/null or /dev/full: a wrong rename would replace them)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import threading

import pytest

import bloom
from generation.jobs import files

GOOD = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0}


def run(argv, capsys):
    code = bloom.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    link = tmp_path / "link.json"
    link.symlink_to(prompts)
    for out in (prompts, link):
        code, err = run(["--input_file", str(prompts), "--output_file", str(out)], capsys)
        assert code == 1 and "same file as --input_file" in error_line(err)
        assert prompts.read_text() == "Hello\n" and link.is_symlink()


@pytest.mark.parametrize("errors_is", ["requests", "results"])
def test_errors_file_may_not_be_the_requests_or_the_results(tmp_path, capsys, errors_is):
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text(json.dumps(GOOD) + "\n")
    results.write_text('{"request": {"prompt": "x"}, "result": {}}\n')
    before = {requests: requests.read_bytes(), results: results.read_bytes()}
    target = requests if errors_is == "requests" else results
    code, err = run(["--requests", str(requests), "--results", str(results), "--errors", str(target)], capsys)
    assert code == 1 and "same file" in error_line(err)
    assert {p: p.read_bytes() for p in before} == before


def test_an_output_symlink_stays_a_link_and_its_target_gets_the_results(tmp_path, capsys):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    code, _ = run(["--max_length", "8", "--output_file", str(link), "--quiet", "Hello"], capsys)
    assert code == 0 and link.is_symlink()
    assert json.loads(target.read_text())[0]["prompt"] == "Hello"


def test_a_fifo_output_is_written_through_not_replaced(tmp_path, capsys):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    files.replace_file(fifo, b'[{"a": 1}]\n')
    reader.join(10)
    assert got == [b'[{"a": 1}]\n'] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_full_disk_is_reported_by_name(tmp_path, monkeypatch):
    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    target = tmp_path / "out.json"
    target.write_text("kept")
    with pytest.raises(files.InputError, match="no space left.*out.json"):
        files.replace_file(target, b"new")
    assert target.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_results_without_a_final_newline_are_repaired_or_refused_never_cut(tmp_path, capsys):
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text(json.dumps(GOOD) + "\n")
    complete = json.dumps({"request": {"prompt": "other"}, "result": {}})
    results.write_text(complete)  # a whole record, its newline missing
    code, _ = run(["--requests", str(requests), "--results", str(results), "--quiet"], capsys)
    lines = results.read_text().splitlines()
    assert code == 0 and lines[0] == complete and len(lines) == 2

    foreign = tmp_path / "notes.jsonl"
    foreign.write_text("my own notes, no newline")
    code, err = run(["--requests", str(requests), "--results", str(foreign), "--quiet"], capsys)
    assert code == 1 and "does not end with a newline" in error_line(err)
    assert foreign.read_text() == "my own notes, no newline"


def test_a_second_run_on_a_locked_results_file_stops_with_a_clear_line(tmp_path, capsys):
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text(json.dumps(GOOD) + "\n")
    with open(results, "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        code, err = run(["--requests", str(requests), "--results", str(results), "--quiet"], capsys)
    assert code == 1 and "in use by another run" in error_line(err)
    assert results.read_bytes() == b""


def test_a_batch_is_saved_before_it_is_printed(tmp_path, capsys, monkeypatch):
    def closed_pipe(*_):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(bloom, "show", closed_pipe)
    out = tmp_path / "out.json"
    code = bloom.main(["--max_length", "8", "--output_file", str(out), "Hello"])
    assert code == 1 and json.loads(out.read_text())[0]["prompt"] == "Hello"


def test_stream_with_an_output_file_writes_it(tmp_path, capsys):
    out = tmp_path / "out.json"
    code, _ = run(["--max_length", "8", "--stream", "--output_file", str(out), "Hello", "World"], capsys)
    records = json.loads(out.read_text())
    assert code == 0 and [r["prompt"] for r in records] == ["Hello", "World"]
    assert all(r["token_ids"] for r in records)


def test_cli_output_to_a_fifo_gets_one_json_list_and_the_fifo_stays(tmp_path, capsys):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    code, _ = run(["--max_length", "8", "--batch_size", "1", "--output_file", str(fifo), "--quiet", "A", "B"], capsys)
    reader.join(30)
    assert code == 0 and [r["prompt"] for r in json.loads(got[0])] == ["A", "B"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_full_device_is_reported_and_stays_a_device(tmp_path, capsys):
    # Our own node for the "full" device (1, 7), made in the temporary folder: the machine's
    # /dev/full is never touched.
    full = tmp_path / "full"
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    code, err = run(["--max_length", "8", "--output_file", str(full), "--quiet", "Hello"], capsys)
    assert code == 1 and "no space left" in error_line(err)
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_request_results_into_a_fifo_are_written_through(tmp_path, capsys):
    requests, fifo = tmp_path / "in.jsonl", tmp_path / "out.fifo"
    requests.write_text(json.dumps(GOOD) + "\n")
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    code, _ = run(["--requests", str(requests), "--results", str(fifo), "--errors", str(tmp_path / "e.jsonl"),
                   "--quiet"], capsys)
    reader.join(30)
    assert code == 0 and json.loads(got[0])["request"] == GOOD
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
