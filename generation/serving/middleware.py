"""The API key of /v1/ paths, and POST bodies read as JSON whatever their Content-Type says."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .openai_format import ApiError


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
