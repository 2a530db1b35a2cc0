"""Prometheus metrics of a serving process (own registry, so several apps can live in one process)."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .engine import EngineMetrics

RATE_WINDOW_S = 10.0  # tokens/s is the rate over this many recent seconds


class PrometheusMetrics(EngineMetrics):
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("bloom_queue_length", "requests waiting for rows", registry=r)
        self.running_rows = Gauge("bloom_running_rows", "rows generating now", registry=r)
        self.graphs = Gauge("bloom_step_signatures", "distinct step shapes run (captured graphs)", registry=r)
        self.tokens_per_second = Gauge("bloom_tokens_per_second", f"tokens generated per second over the last "
                                       f"{RATE_WINDOW_S:.0f} s", registry=r)
        self.generated = Counter("bloom_generated_tokens", "tokens generated", registry=r)
        self.requests = Counter("bloom_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("bloom_time_to_first_token_seconds", "from arrival to the first token", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("bloom_inter_token_latency_seconds", "between two tokens of a row", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        # Speculative decoding (--speculate): verify passes, the guesses they offered, those accepted.
        self.verify_passes = Counter("bloom_speculation_verify_passes", "passes that verified guesses", registry=r)
        self.guesses_offered = Counter("bloom_speculation_guesses_offered", "guesses offered, over rows and passes",
                                       registry=r)
        self.guesses_accepted = Counter("bloom_speculation_guesses_accepted", "guesses accepted", registry=r)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.tokens_per_second.set_function(self._rate)

    def bind(self, engine) -> None:
        """Gauges read from the engine when scraped."""
        self.queue_length.set_function(lambda: engine.queue_length)
        self.running_rows.set_function(lambda: engine.running_rows)
        self.graphs.set_function(lambda: engine.generator.backend.graph_count())
        for name, meaning in (("row_moves", "rows moved to a lower slot (compaction)"),
                              ("bucket_changes", "changes of the batch bucket decode runs in")):
            gauge = Gauge(f"bloom_{name}", meaning, registry=self.registry)
            gauge.set_function(lambda name=name: engine.stats[name])
        pool = engine.generator.runner.prefix
        if pool is not None:  # the prefix cache (docs/prefix-cache.md), read when scraped
            for name, meaning, read in (
                    ("lookups", "prompts looked up in the prefix cache", lambda: pool.stats.lookups),
                    ("hits", "prompts that found blocks in the prefix cache", lambda: pool.stats.hits),
                    ("misses", "prompts that found none", lambda: pool.stats.lookups - pool.stats.hits),
                    ("cached_tokens", "prompt tokens copied from the pool", lambda: pool.stats.cached_tokens),
                    ("prompt_tokens", "prompt tokens looked up", lambda: pool.stats.looked_up_tokens),
                    ("evicted_blocks", "blocks evicted (least recently used)", lambda: pool.stats.evicted_blocks),
                    ("used_blocks", "blocks held now", lambda: pool.used_blocks),
                    ("capacity_blocks", f"blocks the pool holds at most ({pool.block} tokens each)",
                     lambda: pool.capacity)):
                gauge = Gauge(f"bloom_prefix_cache_{name}", meaning, registry=self.registry)
                gauge.set_function(read)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def speculated(self, offered: int, accepted: int) -> None:
        self.verify_passes.inc()
        self.guesses_offered.inc(offered)
        self.guesses_accepted.inc(accepted)

    def tokens(self, count: int) -> None:
        self.generated.inc(count)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, count))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def _rate(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S
