"""The HTTP layer: OpenAI's completions and chat endpoints over the engine (FastAPI + uvicorn).

Thin on purpose, in rooms of one job each: ``routes.py`` reads a body, has it checked
(``openai_format`` over the request core, ``generation/request/parse.py``) and hands its prompts to the
engine (``answer.py``); ``collect.py`` turns the engine's events into one JSON answer and
``stream.py`` into server-sent events (their shapes: ``responses.py``); ``errors.py`` answers
errors in OpenAI's shape and ``middleware.py`` checks the API key. A client that goes away cancels
its requests, and the engine frees their rows at its next step. Here: the app, and ``serve``.
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from .errors import add_error_handlers
from .metrics import PrometheusMetrics
from .middleware import KeyAndJsonBody
from .routes import add_routes
from .schema import state_the_model


def make_app(engine, model_name: str, api_key: str | None = None, metrics: PrometheusMetrics | None = None) -> FastAPI:
    app = FastAPI(title="bloom-hpu", docs_url=None, redoc_url=None)
    # The base model, then the LoRA adapters served beside it (a request's "model" picks one).
    lora = getattr(engine, "lora", None)  # ServedAdapters, or None
    names = [model_name, *(lora.names if lora is not None else ())]
    add_error_handlers(app, metrics)
    app.add_middleware(KeyAndJsonBody, api_key=api_key)
    add_routes(app, engine, names, metrics)

    def openapi() -> dict:  # FastAPI's document, with the served model's bounds on token ids
        if app.openapi_schema is None:
            app.openapi_schema = state_the_model(FastAPI.openapi(app), engine.tokenizer.vocab_size,
                                                 engine.config.max_length)
        return app.openapi_schema

    app.openapi = openapi
    return app


def serve(generator, config, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, log=print, device_rows=None, listener=None) -> None:
    """Warm up, then answer HTTP until interrupted (``./bloom.py --serve``). ``device_rows``: the
    engine's device side when it is not the default one (tensor parallelism: tp_serving.LeaderRows).
    ``listener``: a socket already bound to (host, port) (``listen.bind``); else one is bound here."""
    from .listen import bind
    import threading

    import uvicorn

    from .engine import Engine

    metrics = PrometheusMetrics()
    engine = Engine(generator, config, metrics, device_rows)
    metrics.bind(engine)
    name = model_name or generator.folder.name
    served = getattr(generator, "lora", None)
    lora = list(served.names) if served is not None else []  # adapter names, beside the base model's
    if name in lora:
        raise ValueError(f"the LoRA adapter name {name!r} is the base model's name; give the adapter another")
    app = make_app(engine, name, api_key, metrics)
    listener = listener or bind(host, port)
    port = listener.getsockname()[1]  # --port 0: the port the system chose
    address = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
    start = time.perf_counter()
    engine.start()

    def report():
        engine.ready.wait()
        r = engine.warmup_report or {}
        verify = f" (and {r['verify']} verify)" if r.get("verify") else ""  # --speculate
        if r.get("draft"):  # --speculate draft: the draft model's decode and mixed shapes
            verify = f" (and {r['verify']} verify, {r['draft']} draft)"
        log(f"warm-up: {r.get('prefill', 0)} prefill, {r.get('decode', 0)} decode and {r.get('mixed', 0)} mixed "
            f"shapes{verify} in "
            f"{time.perf_counter() - start:.2f} s; serving {', '.join(map(repr, [name, *lora]))} "
            f"on http://{address}:{port}/v1 "
            f"(max_batch {config.max_batch}, max_length {config.max_length}, bucket_width {config.bucket_width})")

    threading.Thread(target=report, daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[listener])
    finally:
        engine.stop()
        listener.close()
