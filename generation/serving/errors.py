"""Errors as OpenAI shapes them (``{"error": {...}}``): what ``/openapi.json`` says the generation
endpoints may answer besides 200, FastAPI's validation errors as one line naming the field, and the
app's exception handlers."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .openai_format import ApiError, bad_request

_ERROR_BODY = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
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


def add_error_handlers(app: FastAPI, metrics=None) -> None:
    """Every error the app answers, in OpenAI's shape; 4xx of the generation endpoints counted."""

    def count(request: Request, status: int) -> None:
        if metrics is not None:
            metrics.requests.labels(request.url.path, str(status)).inc()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        count(request, error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        message, field = validation_message(error.errors())
        count(request, 400)
        return JSONResponse(bad_request(message, field).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = "not_found" if error.status_code == 404 else None
        # (its headers kept: a 405 says in ``Allow`` which methods the path takes, as RFC 9110 asks)
        return JSONResponse(ApiError(error.status_code, str(error.detail), "invalid_request_error", None, code).body(),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}", "server_error").body(),
                            status_code=500)
