"""Servers for the tests, on the loopback interface only: the app in a thread of the test process,
or ``./bloom.py --serve`` as a process, each ready once /health answers 200."""

from __future__ import annotations

import contextlib
import http.client
import socket
import subprocess
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> int | None:
    """GET /health's status, or None while nothing answers."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/health")
        return connection.getresponse().status
    except OSError:
        return None


@contextlib.contextmanager
def app_in_thread(engine, app):
    """Start ``engine`` and serve ``app`` with uvicorn in a thread; yields the port."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    engine.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        if server.started and engine.ready.is_set():
            break
        time.sleep(0.05)
    assert server.started and engine.ready.is_set()
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()


def wait_until_healthy(proc: subprocess.Popen, port: int, seconds: float, log=lambda: "") -> None:
    """Wait for a server process to answer /health with 200; fail (killing it) if it exits first
    or does not within ``seconds``. ``log()``: what to show when it fails."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        assert proc.poll() is None, log()
        if health(port) == 200:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not get ready: " + log())
