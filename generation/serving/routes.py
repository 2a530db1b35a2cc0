"""The routes: health, Prometheus metrics, the model list, and OpenAI's completions and chat.

The bodies are typed (``schema.py``): FastAPI checks them before these run and documents them.
Parsing and tokenizing a large body runs in a worker thread, so /health and the streams of other
requests never wait behind it.
"""

from __future__ import annotations

import asyncio
import weakref

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from ..run.logprobs import TokenText
from .in_flight import Answer
from .collect import collect
from .errors import ERROR_RESPONSES
from .handles import ENGINE_STOPPED
from .loop_handoff import Mailbox
from .openai_format import ApiError, Completion, parse_chat, parse_completion
from .schema import ChatBody, CompletionBody, as_sent
from .stream import stream

_METRICS_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                       "description": "Prometheus metrics, text exposition format"}}
# The generation endpoints: a JSON answer, or server-sent events with "stream": true; or an error.
_ANSWERS = {200: {"content": {"text/event-stream": {}},
                  "description": "the answer (JSON), or its chunks as server-sent events with \"stream\": true"},
            **ERROR_RESPONSES}


def add_routes(app: FastAPI, engine, names: list[str], metrics=None) -> None:
    """``names``: the served models, the base model first, then the LoRA adapters beside it."""
    lora = getattr(engine, "lora", None)  # ServedAdapters, or None
    mailboxes = weakref.WeakKeyDictionary()  # event loop -> Mailbox (one loop serves the app)
    text_of = TokenText(engine.tokenizer)

    def stopped() -> ApiError:  # the engine's thread ended on an error: nothing will be answered
        return ApiError(503, engine.failure, "server_error", None, ENGINE_STOPPED)

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse(stopped().body(), status_code=503)
        if not engine.ready.is_set():
            return JSONResponse(ApiError(503, "warming up", "server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_METRICS_TEXT)
    async def prometheus():
        if metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "bloom-hpu",
                 "max_model_len": engine.config.max_length} for name in names]
        for entry in data[1:]:  # adapters, as vLLM lists them: their base model as root/parent
            entry |= {"root": str(lora.folders[entry["id"]]), "parent": names[0]}
        return {"object": "list", "data": data}

    @app.post("/v1/completions", responses=_ANSWERS)
    async def completions(request: Request, body: CompletionBody):
        completion = await run_in_threadpool(parse_completion, as_sent(body), names, engine.tokenizer)
        return await respond(request, completion)

    @app.post("/v1/chat/completions", responses=_ANSWERS)
    async def chat(request: Request, body: ChatBody):
        completion = await run_in_threadpool(parse_chat, as_sent(body), names, engine.tokenizer)
        return await respond(request, completion)

    async def respond(request: Request, completion: Completion):
        if engine.failure is not None:
            raise stopped()
        if not engine.ready.is_set():
            raise ApiError(503, "the server is warming up", "server_error")
        loop = asyncio.get_running_loop()
        if loop not in mailboxes:
            mailboxes[loop] = Mailbox(loop)
        answer = await run_in_threadpool(Answer, engine, completion, mailboxes[loop])
        if metrics is not None:
            metrics.requests.labels(request.url.path, "200").inc()
        if completion.stream:
            return StreamingResponse(stream(answer, text_of), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(request, answer, text_of)
