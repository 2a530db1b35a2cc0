"""The load generator of ``bench/serve_bench.py``: streaming clients against a server on a loopback
port, in a process of their own.

The clients are Python threads; in the server's process they would share its interpreter lock, and
on a card, where a decode step takes a millisecond or two, parsing every client's stream would
stretch the server's own steps. ``measure`` runs them in a child process (``python -m
bench.load_client``, the load as JSON on stdin, the timings as JSON on stdout), as an outside
client would be.
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Timing:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    chunk_tokens: list[int] = field(default_factory=list)  # the tokens so far at each (where the server says)
    tokens: int = 0
    done: float = 0.0


def stream_request(port: int, body: dict) -> Timing:
    """One streamed completion; the server's usage count gives the tokens, and (vLLM's
    ``continuous_usage_stats``, where the server has it) the tokens each chunk brings: a token whose
    text is held back (an incomplete UTF-8 character, a possible stop string) arrives with the next."""
    timing = Timing(time.perf_counter())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True,
                                                              "stream_options": {"include_usage": True,
                                                                                 "continuous_usage_stats": True}}))
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}: {response.read()[:200]!r}")
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        usage = chunk.get("usage")
        if usage:
            timing.tokens = usage["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices", [])):
            timing.chunks.append(time.perf_counter())
            if usage:
                timing.chunk_tokens.append(usage["completion_tokens"])
    timing.done = time.perf_counter()
    conn.close()
    return timing


def closed_loop(port: int, bodies: list[dict], clients: int) -> tuple[list[Timing], float]:
    """``clients`` clients, each sending its next request when its last one ended."""
    todo, lock, timings = list(bodies), threading.Lock(), []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                body = todo.pop(0)
            t = stream_request(port, body)
            with lock:
                timings.append(t)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timings, time.perf_counter() - start


def open_loop(port: int, bodies: list[dict], rate: float, seed: int) -> tuple[list[Timing], float]:
    """Poisson arrivals at ``rate`` requests/s, whatever the server's pace."""
    rng, timings, lock, threads = random.Random(seed), [], threading.Lock(), []

    def one(body):
        t = stream_request(port, body)
        with lock:
            timings.append(t)

    start = time.perf_counter()
    for body in bodies:
        threads.append(threading.Thread(target=one, args=(body,)))
        threads[-1].start()
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    return timings, time.perf_counter() - start


def run(spec: dict) -> tuple[list[Timing], float]:
    if spec["kind"] == "closed":
        return closed_loop(spec["port"], spec["bodies"], int(spec["level"]))
    return open_loop(spec["port"], spec["bodies"], float(spec["level"]), spec["seed"])


def measure(port: int, bodies: list[dict], kind: str, level: float, seed: int = 0) -> tuple[list[Timing], float, float]:
    """One load level (``kind`` "closed": ``level`` clients; "open": ``level`` requests/s), run by
    a child process. Returns the timings, the wall time of the whole level and the CPU seconds the
    clients used (all their threads: on a machine of few cores, time the server could not have)."""
    spec = {"port": port, "bodies": bodies, "kind": kind, "level": level, "seed": seed}
    done = subprocess.run([sys.executable, "-m", "bench.load_client"], input=json.dumps(spec), text=True,
                          capture_output=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout)
    return [Timing(**t) for t in out["timings"]], out["wall"], out["cpu"]


def main() -> int:
    spec = json.load(sys.stdin)
    cpu = time.process_time()
    timings, wall = run(spec)
    json.dump({"timings": [asdict(t) for t in timings], "wall": wall, "cpu": time.process_time() - cpu}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
