"""Servers for the tests, on the loopback interface only: the app in a thread of the test process,
or ``./bloom.py --serve`` as a process, each ready once /health answers 200."""

from __future__ import annotations

import contextlib
import dataclasses
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


@dataclasses.dataclass
class Running:
    """A server of the tests: its generator, engine and port, and the official client for it."""

    generator: object
    engine: object
    port: int
    key: str | None = None

    def client(self, timeout: float = 60):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.key or "unused",
                             max_retries=0, timeout=timeout)


@contextlib.contextmanager
def engine_server(generator, model: str = "bloom-tiny", key: str | None = None, metrics: bool = False, **config):
    """``generator`` served by the real app in a thread: an ``Engine`` with ``EngineConfig(**config)``,
    ``key`` required when given, Prometheus metrics when asked; yields ``Running``."""
    from generation.serving.app import make_app
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.metrics import PrometheusMetrics

    exported = PrometheusMetrics() if metrics else None
    engine = Engine(generator, EngineConfig(**config), exported)
    if exported is not None:
        exported.bind(engine)
    with app_in_thread(engine, make_app(engine, model, key, exported)) as port:
        yield Running(generator, engine, port, key)


@contextlib.contextmanager
def tiny_server(key: str, max_length: int, bucket_width: int):
    """The embedded default (fp32, CPU) served with metrics, 8 rows, ``key`` required, in a thread;
    yields (generator, engine, port)."""
    from generation import Generator

    generator = Generator.from_pretrained("checkpoints/bloom-tiny", dtype="fp32", device="cpu")
    with engine_server(generator, "bloom-tiny", key, metrics=True, max_batch=8, max_length=max_length,
                       bucket_width=bucket_width) as running:
        yield running.generator, running.engine, running.port


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
