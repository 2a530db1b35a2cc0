"""The front door of a data-parallel server: one port in front of D replicas (``--serve --data_parallel D``).

Each replica is a whole server of its own (``app.py``: engine, routes, metrics) listening on a
port of its own (loopback on this node, ``dp_serving.py``); this app answers the user's port and
passes each request on to one replica over HTTP, the body and the answer untouched (a stream's
server-sent events are passed through as they come), so a replica answers exactly what one
process answers.

Routing is prefix-aware, as SGLang's router: the engine's prefix cache holds the leading blocks of
the prompts a replica has seen, so a request goes to the replica that last served the longest
leading block of its prompt (blocks of ``BLOCK_CHARS`` characters, hashed), else to the least
loaded one (fewest requests in flight, then fewest routed). A prefix never makes a request queue
on a replica whose rows are all busy while another replica is less loaded (``Router.rows``): a
popular system prompt then spreads, and each replica computes it once.

A replica that stops answering (its port refuses connections: its process is gone), or whose /health
says its engine stopped (its warm-up failed, or its engine's thread ended on an error), is marked down:
the requests it held get a 503 with a JSON error, /health names it, new requests go to the others.
/health is 200 once every replica is ready. /metrics: every replica's metrics with a ``replica``
label, their sums with ``replica="total"``, and the front door's own (replicas up, requests routed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx2 as httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .handles import ENGINE_STOPPED

BLOCK_CHARS = 64  # a leading block of the prompt, in characters (a few of the prefix cache's token blocks)
MAX_BLOCKS = 64  # blocks hashed per prompt: prefixes longer than 4096 characters route as their first 4096
REMEMBERED = 100_000  # leading blocks remembered (least recently used forgotten)
HEALTH_EVERY_S = 0.5


def error_body(status: int, message: str) -> dict:
    """An error in OpenAI's shape, as the replicas answer theirs (errors.py)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": str(status)}}


def prompt_text(body: bytes) -> str:
    """The text a request's prompt begins with, for routing: a completion's (first) prompt, or a
    chat's messages in order. A body that is not JSON routes by nothing (the replica answers 400)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(request, dict):
        return ""
    if "messages" in request:
        messages = request["messages"] if isinstance(request["messages"], list) else []
        return "".join(f"<{m.get('role')}>{m.get('content') if isinstance(m.get('content'), str) else json.dumps(m.get('content'))}"
                       for m in messages if isinstance(m, dict))
    prompt = request.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    return prompt if isinstance(prompt, str) else json.dumps(prompt)  # token ids: their text form


def engine_stopped(answer) -> str | None:
    """The message of a replica's /health answer that says its engine stopped (its process lives on
    but will answer nothing), else None."""
    if answer.status_code != 503:
        return None
    try:
        error = answer.json().get("error") or {}
    except (ValueError, AttributeError):
        return None
    if error.get("code") != ENGINE_STOPPED:
        return None
    return error.get("message") or ENGINE_STOPPED


def leading_blocks(text: str) -> list[bytes]:
    """Hashes of the prompt's leading blocks: of text[:64], text[:128], ... (whole blocks only)."""
    digest, keys = hashlib.blake2b(digest_size=16), []
    for start in range(0, min(len(text) // BLOCK_CHARS, MAX_BLOCKS) * BLOCK_CHARS, BLOCK_CHARS):
        digest.update(text[start:start + BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        keys.append(digest.digest())  # the digest so far: the hash of the whole prefix up to here
    return keys


@dataclass
class Router:
    """Which replica gets a request. Used from the front door's event loop only (no locks).
    ``rows``: each replica's rows (--max_batch). A prefix's replica gets the request while it has a
    free row, or when no replica is less loaded; past that it would queue the request while another
    replica's rows idle, so the other takes it, computes the prefix once and holds it too."""

    count: int
    rows: int = 8
    in_flight: list[int] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)
    up: list[bool] = field(default_factory=list)
    holders: OrderedDict = field(default_factory=OrderedDict)  # leading block's hash -> replicas that served it

    def __post_init__(self):
        self.in_flight, self.routed, self.up = [0] * self.count, [0] * self.count, [True] * self.count

    def choose(self, text: str) -> tuple[int | None, str]:
        """(replica, why: "prefix" or "least_loaded"), or (None, "down") when none is up."""
        live = [r for r in range(self.count) if self.up[r]]
        if not live:
            return None, "down"
        load = lambda r: (self.in_flight[r], self.routed[r], r)
        keys = leading_blocks(text)
        least = min(live, key=load)
        chosen, why = least, "least_loaded"
        for key in reversed(keys):  # the longest leading block a live replica holds
            held = [r for r in self.holders.get(key, ()) if self.up[r]]
            if held:
                holder = min(held, key=load)
                if self.in_flight[holder] < self.rows or self.in_flight[holder] <= self.in_flight[least]:
                    chosen, why = holder, "prefix"
                break
        for key in keys:  # its prefix is now in the chosen replica's cache too
            self.holders[key] = self.holders.get(key, frozenset()) | {chosen}
            self.holders.move_to_end(key)
        while len(self.holders) > REMEMBERED:
            self.holders.popitem(last=False)
        self.routed[chosen] += 1
        return chosen, why


class FrontMetrics:
    def __init__(self, count: int, router: Router):
        self.registry = CollectorRegistry()
        up = Gauge("bloom_replica_up", "1 while the replica answers, 0 once it is down", ["replica"],
                   registry=self.registry)
        flight = Gauge("bloom_replica_in_flight", "requests the front door has sent and not yet seen answered",
                       ["replica"], registry=self.registry)
        for r in range(count):
            up.labels(str(r)).set_function(lambda r=r: float(router.up[r]))
            flight.labels(str(r)).set_function(lambda r=r: router.in_flight[r])
        self.routed = Counter("bloom_routed_requests", "requests routed to a replica, by why it was chosen",
                              ["replica", "reason"], registry=self.registry)


class _Families:
    """A registry-like object for generate_latest: given metric families."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_metrics(texts: dict[int, str]) -> list[Metric]:
    """The replicas' Prometheus texts as families with a ``replica`` label, each sample also summed
    over the replicas (``replica="total"``)."""
    merged: dict[str, Metric] = {}
    totals: dict[str, dict] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            sums = totals.setdefault(family.name, {})
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "replica": str(replica)}, s.value)
                key = (s.name, tuple(sorted(s.labels.items())))
                sums[key] = sums.get(key, 0.0) + s.value
    for name, sums in totals.items():
        for (sample, labels), value in sums.items():
            merged[name].add_sample(sample, {**dict(labels), "replica": "total"}, value)
    return list(merged.values())


class Upstreams:
    """The replicas as the front door sees them: their URLs, health and load, and one HTTP client."""

    def __init__(self, urls: list[str], router: Router, log, request_timeout: float | None):
        self.urls, self.router, self.log, self.request_timeout = urls, router, log, request_timeout
        self.health = ["starting"] * len(urls)
        self.reported = False
        self.client: httpx.AsyncClient | None = None

    def mark_down(self, replica: int, why: str) -> None:
        if self.router.up[replica]:
            self.router.up[replica] = False
            self.health[replica] = "down"
            self.log(f"replica {replica} is down ({why}); the others keep serving")

    async def watch(self) -> None:
        """Poll each replica's /health: ready, warming up, or down (its port refuses)."""
        while True:
            for replica, url in enumerate(self.urls):
                if not self.router.up[replica]:
                    continue  # a dead replica's port may be taken by another program: never trust it again
                try:
                    answer = await self.client.get(f"{url}/health", timeout=2.0)
                    stopped = engine_stopped(answer)
                    if stopped:
                        self.mark_down(replica, stopped)
                        continue
                    self.health[replica] = "ready" if answer.status_code == 200 else "warming up"
                except httpx.ConnectError as error:
                    self.mark_down(replica, f"its port refuses connections: {error}")
                except httpx.TimeoutException:  # bound but not yet answering: still loading its weights
                    self.health[replica] = "starting"
                except httpx.HTTPError as error:
                    self.mark_down(replica, str(error) or type(error).__name__)
            if not self.reported and all(h == "ready" for h in self.health):
                self.reported = True
                self.log(f"front door: {len(self.urls)} replicas ready")
            await asyncio.sleep(HEALTH_EVERY_S)

    @contextlib.asynccontextmanager
    async def running(self, app):
        """The app's lifespan: the client and the health watcher live as long as the server."""
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        watcher = asyncio.create_task(self.watch())
        try:
            yield
        finally:
            watcher.cancel()
            await self.client.aclose()

    def health_answer(self) -> dict | JSONResponse:
        replicas = [{"replica": r, "status": h, "url": u} for r, (h, u) in enumerate(zip(self.health, self.urls))]
        if all(h == "ready" for h in self.health):
            return {"status": "ok", "replicas": replicas}
        down = [r for r, h in enumerate(self.health) if h == "down"]
        message = (f"replica {', '.join(map(str, down))} {'is' if len(down) == 1 else 'are'} down" if down
                   else "warming up")
        return JSONResponse(error_body(503, message) | {"replicas": replicas}, status_code=503)

    async def scrape(self) -> dict[int, str]:
        """Each live replica's /metrics text."""
        async def one(url):
            try:
                answer = await self.client.get(f"{url}/metrics", timeout=5.0)
                return answer.text if answer.status_code == 200 else None
            except httpx.HTTPError:
                return None

        texts = await asyncio.gather(*(one(url) for url in self.urls))
        return {r: t for r, t in enumerate(texts) if t is not None and self.router.up[r]}

    async def forward(self, request: Request, replica: int, body: bytes) -> Response:
        """Send the request to ``replica``; its answer back as it comes (a stream event by event)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream = self.client.build_request(request.method, f"{self.urls[replica]}{request.url.path}", content=body,
                                             headers=headers, params=request.query_params)
        self.router.in_flight[replica] += 1
        try:
            answer = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            self.router.in_flight[replica] -= 1
            if isinstance(error, httpx.ConnectError):
                self.mark_down(replica, f"its port refuses connections: {error}")
            return JSONResponse(error_body(503, f"replica {replica} is down ({type(error).__name__})"), status_code=503)
        kept = {k: v for k, v in answer.headers.items()
                if k.lower() in ("content-type", "cache-control", "www-authenticate", "allow")}
        if "text/event-stream" in answer.headers.get("content-type", ""):
            return StreamingResponse(self._events(answer, replica), status_code=answer.status_code, headers=kept)
        try:
            content = await answer.aread()
        except httpx.HTTPError as error:  # it died while answering
            return JSONResponse(error_body(503, f"replica {replica} failed while answering "
                                                f"({type(error).__name__})"), status_code=503)
        finally:
            self.router.in_flight[replica] -= 1
            await answer.aclose()
        return Response(content, status_code=answer.status_code, headers=kept)

    async def _events(self, answer, replica: int):
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as error:  # the replica died mid-stream: say so in the stream's own terms
            failed = error_body(503, f"replica {replica} failed while answering ({type(error).__name__})")
            yield f"data: {json.dumps(failed)}\n\n".encode()
        finally:
            self.router.in_flight[replica] -= 1
            await answer.aclose()


def make_front_door(urls: list[str], log=print, rows: int = 8,
                    request_timeout: float | None = None) -> FastAPI:
    """The app on the user's port; ``urls``: each replica's base URL (``http://127.0.0.1:PORT``)."""
    router = Router(len(urls), rows)
    metrics = FrontMetrics(len(urls), router)
    upstreams = Upstreams(urls, router, log, request_timeout)
    app = FastAPI(title="bloom-hpu front door", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.lifespan_context = upstreams.running

    @app.get("/health")
    async def health():
        return upstreams.health_answer()

    @app.get("/metrics")
    async def prometheus():
        families = merge_metrics(await upstreams.scrape())
        body = generate_latest(_Families(families)) + generate_latest(metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        for replica in range(len(urls)):  # every replica serves the same models: ask a live one
            if router.up[replica]:
                return await upstreams.forward(request, replica, b"")
        return JSONResponse(error_body(503, "every replica is down"), status_code=503)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generate(request: Request):
        body = await request.body()
        replica, why = router.choose(prompt_text(body))
        if replica is None:
            return JSONResponse(error_body(503, "every replica is down"), status_code=503)
        metrics.routed.labels(str(replica), why).inc()
        return await upstreams.forward(request, replica, body)

    app.state.router = router
    return app


class FrontDoor:
    """The front door served by uvicorn on a thread of global rank 0, beside its own replica."""

    def __init__(self, urls: list[str], listener, log=print, rows: int = 8):
        import uvicorn

        self.app = make_front_door(urls, log, rows)
        self.listener = listener
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True,
                                       name="front-door")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.listener.close()
