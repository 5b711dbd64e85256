"""--api-key: every endpoint but the public ones needs 'Authorization: Bearer KEY' (OpenAI's
clients) or 'x-api-key: KEY' (Anthropic's)."""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.anthropic.errors import error_body
from pagedllm.entrypoints.openai.serving_common import OpenAIError

# answered without the key: probes and the API's description
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs",
                          "/docs/oauth2-redirect", "/redoc"})


class ApiKeyAuth:
    """ASGI middleware answering 401 without the key. Plain ASGI rather than Starlette's
    BaseHTTPMiddleware, which runs the app in a task group: errors raised while the body is read
    (bounded_http's 408 and 413) would reach FastAPI wrapped in an ExceptionGroup."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()
        self._bearer = f"Bearer {api_key}".encode()

    def _authorized(self, headers: Headers) -> bool:
        # both compared, whichever is sent: the time taken tells nothing about the key
        bearer = hmac.compare_digest(headers.get("authorization", "").encode(), self._bearer)
        key = hmac.compare_digest(headers.get("x-api-key", "").encode(), self._key)
        return bearer or key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            if not self._authorized(Headers(scope=scope)):
                err = OpenAIError("invalid or missing API key: send 'Authorization: Bearer KEY' "
                                  "or 'x-api-key: KEY'", 401)
                await JSONResponse(error_body(scope["path"], err), status_code=401)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)
