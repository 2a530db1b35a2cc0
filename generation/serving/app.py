"""The HTTP layer: OpenAI's completions and chat endpoints over the engine (FastAPI + uvicorn).

Thin on purpose: read the body, check it (``openai_format``), hand prompts to the engine, and turn
its events into a JSON answer or server-sent events. The engine's scheduler thread calls each
request's sink; the sink moves the event into the request's asyncio queue on the server's loop.
A client that goes away cancels its requests, and the engine frees their rows at its next step.
"""

from __future__ import annotations

import asyncio
import time
import weakref

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..logprobs import TokenText
from .engine import EngineError, QueueFull
from .loop_handoff import Mailbox, drain
from .metrics import PrometheusMetrics
from .params import SamplingParams
from .openai_format import (OPENAI_FINISH, ApiError, Completion, bad_request, chat_choice, chat_logprobs,
                            completion_logprobs, envelope, new_id, parse_chat, parse_completion, sse)
from .schema import ChatBody, CompletionBody, as_sent

POLL_S = 0.25  # how often a waiting non-streamed request looks whether its client is still there
_ERROR_BODY = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
# What /openapi.json says the generation endpoints may answer besides 200.
ERROR_RESPONSES = {status: {"description": what, "content": {"application/json": {"schema": _ERROR_BODY}}}
                   for status, what in ((400, "the body is malformed or asks for what cannot run"),
                                        (401, "the API key is missing or wrong"),
                                        (404, "no such model"),
                                        (503, "the server is warming up or its queue is full; retry later"))}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's first validation error as (our one-line message, the top-level field it is about)."""
    error = errors[0] if errors else {}
    loc = [part for part in error.get("loc", ()) if part != "body"]
    where = ".".join(map(str, loc))
    field = str(loc[0]) if loc else None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return "the body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"unknown key {loc[-1]!r}" + (f" in {'.'.join(map(str, loc[:-1]))}" if len(loc) > 1 else ""), field
    if not loc:
        return f"the body must be a JSON object ({error.get('msg', 'invalid')})", None
    if kind == "missing":
        return f"{where} is required", field
    return f"{where}: {error.get('msg', 'invalid value')}", field


class Answer:
    """One HTTP request's prompts in the engine, and the events coming back for them."""

    def __init__(self, engine, completion: Completion, mailbox: Mailbox):
        self.engine, self.completion = engine, completion
        self.events: asyncio.Queue = asyncio.Queue()
        self.handles = []
        request = completion.request
        tokenizer = engine.tokenizer
        prompts = len(request.prompt_ids or request.prompts)
        if prompts > engine.config.max_queue:
            raise bad_request(f"the request has {prompts} prompts; this server queues at most "
                              f"{engine.config.max_queue} (--max_queue): send fewer at a time", "prompt")
        self.prompt_ids = request.prompt_ids or tokenizer.encode_batch(request.prompts)

        def sink(prompt: int):
            return lambda event: mailbox.post(self.events, (prompt, event))

        if engine.flush_events is None:
            engine.flush_events = lambda: drain(mailbox.loop)

        # The LoRA adapter the request's model names (0: the base model).
        lora = getattr(engine, "lora", None)
        adapter = lora.names.get(completion.model, 0) if lora is not None else 0
        if completion.offline:
            # Its search options against the model, on this thread (no collective: under tensor
            # parallelism only rank 0 answers HTTP; the memory is checked inside the offline
            # answer, which every rank makes).
            from ..options import OptionError
            from ..validate import check_against_model

            try:
                check_against_model(request.to_options(), engine.generator.model.config.vocab_size)
            except (OptionError, ValueError) as error:
                raise bad_request(str(error)) from None
        try:
            if completion.offline:
                self.handles.append(engine.submit_offline(request, self.prompt_ids, sink(0), adapter))
            else:
                params = SamplingParams.of(request, adapter)
                for p, ids in enumerate(self.prompt_ids):
                    self.handles.append(engine.submit(ids, params, sink(p)))
        except EngineError as error:
            self.cancel()
            param = "messages" if completion.chat and error.param == "prompt" else error.param
            raise bad_request(f"prompt {len(self.handles) + 1}: {error}" if len(self.prompt_ids) > 1 else str(error),
                              param) from None
        except QueueFull as error:
            self.cancel()
            raise ApiError(503, str(error), "server_error", None, "queue_full") from None

    @property
    def expected(self) -> int:
        """Final events to wait for: one "record" offline, one "done" per prompt otherwise."""
        return 1 if self.completion.offline else len(self.handles)

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()


class KeyAndJsonBody:
    """ASGI middleware: the API key of /v1/ paths, and a POST body read as JSON whatever its
    Content-Type says (``curl -d`` sends form encoding, some clients none; FastAPI parses a typed
    body only under a JSON content type). Plain ASGI, not Starlette's ``BaseHTTPMiddleware``, which
    would pass every chunk of every stream through a memory stream and a task of its own."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}" if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected is not None and scope["path"].startswith("/v1/"):
            sent = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            if sent != self.expected:
                response = JSONResponse(ApiError(401, "invalid API key", "invalid_request_error", None,
                                                 "invalid_api_key").body(), status_code=401)
                return await response(scope, receive, send)
        if scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def make_app(engine, model_name: str, api_key: str | None = None, metrics: PrometheusMetrics | None = None) -> FastAPI:
    app = FastAPI(title="bloom-hpu", docs_url=None, redoc_url=None)
    # The base model, then the LoRA adapters served beside it (a request's "model" picks one).
    lora = getattr(engine, "lora", None)  # ServedAdapters, or None
    names = [model_name, *(lora.names if lora is not None else ())]
    mailboxes = weakref.WeakKeyDictionary()  # event loop -> Mailbox (one loop serves the app)
    text_of = TokenText(engine.tokenizer)
    n_of = lambda c: c.request.n  # noqa: E731

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        if metrics is not None:
            metrics.requests.labels(request.url.path, str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        message, field = validation_message(error.errors())
        if metrics is not None:
            metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(bad_request(message, field).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = "not_found" if error.status_code == 404 else None
        return JSONResponse(ApiError(error.status_code, str(error.detail), "invalid_request_error", None, code).body(),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}", "server_error").body(),
                            status_code=500)

    app.add_middleware(KeyAndJsonBody, api_key=api_key)

    @app.get("/health")
    async def health():
        if not engine.ready.is_set():
            return JSONResponse(ApiError(503, "warming up", "server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus metrics, text exposition format"}})
    async def prometheus():
        if metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "bloom-hpu",
                 "max_model_len": engine.config.max_length} for name in names]
        for entry in data[1:]:  # adapters, as vLLM lists them: their base model as root/parent
            entry |= {"root": str(lora.folders[entry["id"]]), "parent": model_name}
        return {"object": "list", "data": data}

    # The bodies are typed (schema.py): FastAPI checks them before these run and documents them.
    # Parsing and tokenizing a large body runs in a worker thread, so /health and the streams of
    # other requests never wait behind it.
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(request: Request, body: CompletionBody):
        completion = await run_in_threadpool(parse_completion, as_sent(body), names, engine.tokenizer)
        return await respond(request, completion)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat(request: Request, body: ChatBody):
        completion = await run_in_threadpool(parse_chat, as_sent(body), names, engine.tokenizer)
        return await respond(request, completion)

    async def respond(request: Request, completion: Completion):
        if not engine.ready.is_set():
            raise ApiError(503, "the server is warming up", "server_error")
        loop = asyncio.get_running_loop()
        if loop not in mailboxes:
            mailboxes[loop] = Mailbox(loop)
        answer = await run_in_threadpool(Answer, engine, completion, mailboxes[loop])
        if metrics is not None:
            metrics.requests.labels(request.url.path, "200").inc()
        if completion.stream:
            return StreamingResponse(stream(answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(request, answer)

    # --- whole answers ----------------------------------------------------------------------------

    async def collect(request: Request, answer: Answer):
        c = answer.completion
        kind = "chat.completion" if c.chat else "text_completion"
        sequences, logprobs, usage, ended, record = {}, {}, _zero_usage(), 0, None
        try:
            while ended < answer.expected:
                try:
                    p, event = await asyncio.wait_for(answer.events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        answer.cancel()
                        return Response(status_code=499)
                    continue
                index = p * n_of(c) + event.index
                if event.kind == "delta" and event.logprobs is not None:
                    logprobs.setdefault(index, []).extend(event.logprobs)
                elif event.kind == "finish":
                    sequences[index] = (p, event.sequence)
                elif event.kind in ("done", "record"):
                    ended += 1
                    record = event.record if event.kind == "record" else None
                    usage = _add(usage, event.usage or (record or {}).get("usage"))
                elif event.kind == "error":
                    raise ApiError(500, event.message, "server_error")
        finally:
            answer.cancel()  # (no-op for finished requests)
        if record is not None:
            choices = [chat_choice(choice) for choice in record["choices"]] if c.chat else record["choices"]
            return envelope(kind, new_id(c.chat), c.model, choices, record["usage"])
        choices = []
        for index in sorted(sequences):
            p, seq = sequences[index]
            lps = logprobs.get(index) if c.request.logprobs is not None else None
            reason = OPENAI_FINISH[seq.finish_reason]
            if c.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": seq.text},
                                "logprobs": chat_logprobs(text_of, seq.token_ids, lps, seq.text) if lps is not None else None,
                                "finish_reason": reason})
            else:
                prompt = c.request.prompts[p] if c.request.echo else ""
                choices.append({"index": index, "text": prompt + seq.text,
                                "logprobs": completion_logprobs(text_of, seq.token_ids, lps, seq.text)
                                if lps is not None else None, "finish_reason": reason})
        return envelope(kind, new_id(c.chat), c.model, choices, usage)

    # --- streams ----------------------------------------------------------------------------------

    async def stream(answer: Answer):
        c = answer.completion
        rid, kind = new_id(c.chat), "chat.completion.chunk" if c.chat else "text_completion"
        usage, ended = _zero_usage(), 0
        given: dict[int, int] = {}  # characters of each choice's completion sent so far (text_offset)
        sent: dict[int, list[int]] = {}  # token ids of each choice sent so far

        def chunk(index, text="", finish=None, token_ids=(), lps=None):
            if c.chat:
                delta = {"content": text} if text else {}
                logprobs = chat_logprobs(text_of, list(token_ids), lps, text, sent.get(index, [])) if lps else None
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                logprobs = completion_logprobs(text_of, list(token_ids), lps, text, given.get(index, 0),
                                               sent.get(index, [])) if lps else None
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse(envelope(kind, rid, c.model, [choice], running_usage(token_ids)))

        prompt_tokens = sum(len(ids) for ids in answer.prompt_ids)

        def running_usage(token_ids=()):
            """vLLM's continuous_usage_stats: the usage so far on every chunk (None without it)."""
            if not c.continuous_usage:
                return None
            completion = sum(map(len, sent.values())) + len(token_ids)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        try:
            choices = len(answer.prompt_ids) * n_of(c)
            for index in range(choices):
                if c.chat:
                    yield sse(envelope(kind, rid, c.model, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                                "logprobs": None, "finish_reason": None}],
                                       running_usage()))
                elif c.request.echo and not c.offline:
                    yield chunk(index, c.request.prompts[index // n_of(c)])
            while ended < answer.expected:
                p, event = await answer.events.get()
                index = p * n_of(c) + event.index
                if event.kind == "delta":
                    yield chunk(index, event.text, None, event.token_ids, event.logprobs)
                    given[index] = given.get(index, 0) + len(event.text)
                    sent.setdefault(index, []).extend(event.token_ids)
                elif event.kind == "finish":
                    yield chunk(index, "", OPENAI_FINISH[event.finish_reason])
                elif event.kind == "done":
                    ended += 1
                    usage = _add(usage, event.usage)
                elif event.kind == "record":
                    # An offline answer arrives whole: each choice is one chunk (chat: its text,
                    # then its finish), with the final usage on each when usage is continuous.
                    ended += 1
                    usage = _add(usage, event.record["usage"])
                    every = event.record["usage"] if c.continuous_usage else None
                    for choice in event.record["choices"]:
                        if c.chat:
                            message = chat_choice(choice)
                            text, finish = message["message"]["content"], message["finish_reason"]
                            for delta, reason in (({"content": text}, None), ({}, finish)):
                                yield sse(envelope(kind, rid, c.model, [{"index": message["index"], "delta": delta,
                                                                         "logprobs": None, "finish_reason": reason}],
                                                   every))
                        else:
                            yield sse(envelope(kind, rid, c.model, [choice], every))
                elif event.kind == "error":
                    yield sse(ApiError(500, event.message, "server_error").body())
                    break
            if c.include_usage:
                yield sse(envelope(kind, rid, c.model, [], usage))
            yield "data: [DONE]\n\n"
        finally:
            answer.cancel()  # a closed stream frees its rows at the engine's next step

    return app


def _zero_usage() -> dict:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _add(usage: dict, more: dict | None) -> dict:
    if not more:
        return usage
    return {k: usage[k] + more.get(k, 0) for k in usage}


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
        log(f"warm-up: {r.get('prefill', 0)} prefill, {r.get('decode', 0)} decode and {r.get('mixed', 0)} mixed shapes in "
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
