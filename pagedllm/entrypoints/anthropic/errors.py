"""Errors of the Messages API in Anthropic's shape: {"type": "error", "error": {type, message}}."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.serving_common import MESSAGES, OpenAIError

# Anthropic's error types by HTTP status (its docs' table); other 4xx are invalid requests
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether a request path belongs to the Messages API (its errors take Anthropic's shape)."""
    return path == MESSAGES or path.startswith(MESSAGES + "/")


def anthropic_error_body(err: OpenAIError) -> dict[str, Any]:
    """The error as Anthropic's error object; the message names the field, as OpenAI's param
    would (Anthropic's object has no param)."""
    kind = _TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, err: OpenAIError) -> dict[str, Any]:
    """The body answering err on path: Anthropic's shape under /v1/messages, else OpenAI's."""
    return anthropic_error_body(err) if is_messages_path(path) else err.body()
