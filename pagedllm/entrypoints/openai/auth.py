"""--api-key: every endpoint but the public ones needs 'Authorization: Bearer KEY'."""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.openai.serving_common import OpenAIError

# answered without the key: probes and the API's description
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs",
                          "/docs/oauth2-redirect", "/redoc"})


class ApiKeyAuth:
    """ASGI middleware answering 401 without the key. Plain ASGI rather than Starlette's
    BaseHTTPMiddleware, which runs the app in a task group: errors raised while the body is read
    (bounded_http's 408 and 413) would reach FastAPI wrapped in an ExceptionGroup."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                err = OpenAIError("invalid or missing API key: send 'Authorization: Bearer KEY'",
                                  401)
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
