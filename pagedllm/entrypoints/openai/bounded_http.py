"""The bounds of limits.HttpLimits on what one HTTP request may cost the server before a
handler runs: the body's size (413) and how long the server waits on a client's bytes (408, or
the connection is closed).

Two layers, because uvicorn has neither bound:
- BoundedBodies (ASGI middleware) refuses a declared Content-Length over the limit before reading
  a byte, counts the bytes of a chunked body as they arrive, and gives each body read
  read_timeout_s: a Content-Length longer than the body sent gets a 408, not a wait forever.
- ReadTimedH11Protocol (uvicorn's h11 protocol) closes a connection whose request headers have
  not arrived within read_timeout_s, or whose body is still trickling in after the response
  went out: half-open connections do not stay open indefinitely. It also disconnects a client
  that takes no response bytes for send_stall_timeout_s while the server has more for it (the
  transport paused its writer: the socket is full), which aborts that client's requests, and
  caps each connection's kernel send buffer at send_buffer_bytes, so that a client that does
  not read is noticed after a few hundred kilobytes rather than after the 4 MB autotuning allows.
uvicorn's limit_concurrency is not set: it counts idle connections too (a few thousand
half-open ones would turn every request away) and answers in plain text; the deadline frees
them instead. Starlette's RequestBodyLimitMiddleware (FastAPI's max_body_size) is not used:
it answers in plain text or FastAPI's {"detail"} and looks at Content-Length only once the app
reads the body or starts its response.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Optional

import h11
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.limits import (DEFAULT_READ_TIMEOUT_S,
                                                DEFAULT_SEND_BUFFER_BYTES,
                                                DEFAULT_SEND_STALL_TIMEOUT_S, HttpLimits)
from pagedllm.entrypoints.anthropic.errors import error_body
from pagedllm.entrypoints.openai.serving_common import OpenAIError

logger = logging.getLogger("pagedllm")


class BodyTooLarge(HTTPException):
    """413: the body passed max_body_bytes while being read. An HTTPException, so that FastAPI
    passes it on from its body reading to the app's error handler unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large(limit))


class BodyTimeout(HTTPException):
    """408: the client sent no body bytes for read_timeout_s; the connection is then closed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body stopped arriving: no bytes for {seconds:g} s "
                         "(a Content-Length longer than the body sent?)",
                         headers={"Connection": "close"})


def _too_large(limit: int, declared: Optional[int] = None) -> str:
    size = f"is {declared} bytes" if declared is not None else f"is over {limit} bytes"
    return (f"the request body {size}; this server takes at most {limit} "
            "(--max-request-body-bytes)")


class BoundedBodies:
    """ASGI middleware: the body limit and body read timeout of HttpLimits."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.max_body_bytes:
            # answered before reading: uvicorn discards the body that still arrives
            err = OpenAIError(_too_large(self.limits.max_body_bytes, declared), 413)
            await JSONResponse(error_body(scope["path"], err), status_code=413)(
                scope, receive, send)
            return
        await self.app(scope, _BodyReader(receive, self.limits).receive, send)


class _BodyReader:
    """One request's receive(): body bytes counted against the limit, each read timed."""

    def __init__(self, receive: Receive, limits: HttpLimits) -> None:
        self._receive, self._limits = receive, limits
        self._read = 0
        self._done = False  # the whole body is in: later reads wait for a disconnect, untimed

    async def receive(self) -> Message:
        if self._done:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), self._limits.read_timeout_s)
        except TimeoutError:
            raise BodyTimeout(self._limits.read_timeout_s) from None
        if message["type"] != "http.request":
            self._done = True
            return message
        self._read += len(message.get("body", b""))
        if self._read > self._limits.max_body_bytes:
            raise BodyTooLarge(self._limits.max_body_bytes)
        self._done = not message.get("more_body", False)
        return message


def _content_length(scope: Scope) -> Optional[int]:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 has refused a malformed one already
    return None


class ReadTimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the client: while the server waits on it (for a
    request's headers, or for the rest of a body after the response went out), the client has
    read_timeout_s to finish, else the connection is closed. uvicorn itself times out only
    connections idle after a response (timeout_keep_alive)."""

    read_timeout_s = DEFAULT_READ_TIMEOUT_S
    send_stall_timeout_s = DEFAULT_SEND_STALL_TIMEOUT_S
    send_buffer_bytes = DEFAULT_SEND_BUFFER_BYTES
    _deadline: Optional[asyncio.TimerHandle] = None
    _stall: Optional[asyncio.TimerHandle] = None  # armed while the transport's writer is paused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel()
        self._cancel_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client has stopped taking."""
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.send_stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        """The client took bytes again."""
        super().resume_writing()
        self._cancel_stall()

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if self.transport.is_closing():
            return
        what = f" ({self.cycle.scope['method']} {self.cycle.scope['path']})" if self.cycle else ""
        peer = "%s:%d" % self.client if self.client else "?"
        logger.warning("client %s%s: disconnected: it took no response bytes for %g s "
                       "(--send-stall-timeout); its requests are aborted", peer, what,
                       self.send_stall_timeout_s)
        # abort, not close: the buffered bytes the client will not take are dropped at once;
        # connection_lost then ends the response as a client disconnect does
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as OpenAI's error object."""
        body = json.dumps(OpenAIError(f"invalid HTTP request: {msg}", 400).body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _waiting_on_client(self) -> bool:
        theirs, ours = self.conn.their_state, self.conn.our_state
        return theirs is h11.IDLE or (theirs is h11.SEND_BODY and ours in (h11.DONE,
                                                                           h11.MUST_CLOSE))

    def _watch(self) -> None:
        if not self._waiting_on_client():
            self._cancel()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._expire)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(limits: HttpLimits) -> dict[str, object]:
    """uvicorn.run's keyword arguments for these limits."""
    protocol = type("ReadTimedH11Protocol", (ReadTimedH11Protocol,),
                    {"read_timeout_s": limits.read_timeout_s,
                     "send_stall_timeout_s": limits.send_stall_timeout_s,
                     "send_buffer_bytes": limits.send_buffer_bytes})
    return {"http": protocol}


__all__ = ["BodyTimeout", "BodyTooLarge", "BoundedBodies", "ReadTimedH11Protocol",
           "uvicorn_options"]
