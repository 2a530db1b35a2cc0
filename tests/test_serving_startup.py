"""Starting the server as a 176B user needs it: the address is checked and bound before the weights
load, so a busy port, an unknown host or a port out of range is one error line at once; an empty
--api_key and a --peft_weights file are refused."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bloom(*args, timeout=120):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "bloom.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    return done, time.perf_counter() - start


def one_error_line(done) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "serving" not in done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_a_busy_port_is_one_line_before_anything_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done, seconds = bloom("--serve", "--port", str(port))
    assert "already in use" in one_error_line(done)
    assert "loaded" not in done.stderr  # refused before the weights were read


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "not a port number"),
    (["--host", "no-such-host.invalid"], "not an address of this machine"),
    (["--api_key", ""], "--api_key is empty"),
])
def test_bad_addresses_and_an_empty_key_are_one_line(args, message):
    done, _ = bloom("--serve", *args)
    assert message in one_error_line(done)


def test_peft_weights_given_a_file_says_it_is_not_a_folder(tmp_path):
    adapter = tmp_path / "adapter_model.safetensors"
    adapter.write_bytes(b"not a folder")
    done, _ = bloom("--peft_weights", str(adapter), "Hello")
    assert "is a file, not an adapter folder" in one_error_line(done)


def test_port_0_serves_on_the_port_the_system_chose_and_says_which():
    import re

    from servers import health

    proc = subprocess.Popen([sys.executable, str(ROOT / "bloom.py"), "--serve", "--port", "0", "--max_length", "32",
                             "--max_batch", "2", "--bucket_width", "16"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # until the line that says where it serves
            lines.append(line)
            found = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", line)
            if found:
                break
        assert found, "".join(lines)
        port = int(found.group(1))
        assert port != 0 and health(port) == 200
    finally:
        proc.terminate()
        proc.wait(30)
