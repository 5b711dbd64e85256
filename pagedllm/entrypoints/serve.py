"""`pagedllm serve`: bind the port, load the model, start the OpenAI-compatible server, say how
to call it."""
from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import gc
import logging
import os
import signal
import socket
import sys
from typing import Awaitable, Callable, Optional

import uvicorn

from pagedllm.config import DEFAULT_MAX_STREAM_BACKLOG
from pagedllm.engine.arg_utils import EngineArgs, add_ignored_cli_args
from pagedllm.entrypoints.drain import DEFAULT_SHUTDOWN_TIMEOUT_S
from pagedllm.entrypoints.openai.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CLIENT_SHARE,
                                                DEFAULT_READ_TIMEOUT_S, DEFAULT_SEND_BUFFER_BYTES,
                                                DEFAULT_SEND_STALL_TIMEOUT_S, HttpLimits,
                                                SlotLimits)
from pagedllm.entrypoints.openai.lora_modules import lora_modules
from pagedllm.entrypoints.openai.response_store import (DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES,
                                                        ResponseStore)
from pagedllm.hub.model_store import DEFAULT_MODEL
from pagedllm.structured_output.reasoning import parser_for_template

logger = logging.getLogger("pagedllm")
STATS_INTERVAL_ENV_VARS = ("PAGEDLLM_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL")
HONORED_VLLM_ARGS = frozenset({"disable_log_stats"})  # LLM() ignores them; the server does not


class PortInUseError(OSError):
    """The port `serve` was asked to listen on is taken."""


class _ModelOnce(argparse.Action):
    """The model, positional or --model: given twice is a usage error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:  # the optional positional, absent
            return
        if getattr(namespace, self.dest, None) is not None:
            parser.error("the model is given twice: pass it positionally or with --model, "
                         "not both")
        setattr(namespace, self.dest, values)


def add_serve_parser(sub) -> None:
    """The `serve` sub-command's flags (vLLM's names)."""
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Serve MODEL over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None, action=_ModelOnce,
                   help=f"a .gguf file, an HF directory, a Hub id or a known name (default: "
                   f"{DEFAULT_MODEL})")
    p.add_argument("--model", dest="model", default=None, action=_ModelOnce, metavar="MODEL",
                   help="the model as a flag, as vLLM's older command lines give it "
                   f"(default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="name clients send as `model` "
                   "(default: the model argument)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--lora-modules", action="extend", nargs="+", default=None,
                   metavar="NAME=PATH", help="LoRA adapters served by name as a request's "
                   "model: name=path, or JSON {\"name\": ..., \"path\": ..., "
                   "\"base_model_name\": ...} (needs --enable-lora; docs/lora.md; "
                   "default: none)")
    _add_slot_flags(p)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every "
                   "endpoint but /health, /metrics, /version and the API docs (default: "
                   "$PAGEDLLM_API_KEY, else no key)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: "
                   "the model's)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=None, help='let requests with tools use tool_choice "auto" (needs a '
                   "tool-call parser; default: on when the parser comes from the chat template; "
                   "--no-enable-auto-tool-choice refuses it, as vLLM does without the flag)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are read from the output (default: the one the chat "
                   "template implies, if any)")
    p.add_argument("--responses-store-max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                   help="most /v1/responses responses kept in memory for GET and "
                   "previous_response_id (store=true); the least recently used go first")
    p.add_argument("--responses-store-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="most JSON bytes of stored /v1/responses responses and their "
                   "conversations kept in memory")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='do not render tools in the prompt when tool_choice is "none"')
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond this get HTTP 503 (a prompt list longer than "
                   "this, 400)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get HTTP 413, refused while being read")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="seconds the server waits on a client's request headers or body "
                   "bytes; then 408 or the connection is closed")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, seconds the streams in flight may take to finish (new "
                   "requests get 503 at once); then each left gets an error event and [DONE] "
                   "and the server exits 0")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request")
    p.add_argument("--enable-log-requests", action="store_true", help="vLLM's switch for the "
                   "request lines, which are on here unless --disable-log-requests")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput line (every $VLLM_LOG_STATS_INTERVAL or "
                   "$PAGEDLLM_LOG_STATS_INTERVAL seconds, default 10, while busy)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level")
    add_ignored_cli_args(p, exclude=HONORED_VLLM_ARGS)


def _add_slot_flags(p: argparse.ArgumentParser) -> None:
    """How many sequence slots one client may hold, and for how long while it does not read
    (limits.HttpLimits, limits.SlotLimits; docs/server_limits.md)."""
    p.add_argument("--max-client-share", type=float, default=DEFAULT_MAX_CLIENT_SHARE,
                   help="share of --max-num-seqs one client (peer address) may have in flight, "
                   "n x prompts over its requests; past it the client's next request waits for "
                   "its own to finish (HTTP 429 once more than --max-waiting of its sequences "
                   "wait); 1 turns the cap off")
    p.add_argument("--max-stream-backlog", type=int, default=DEFAULT_MAX_STREAM_BACKLOG,
                   help="outputs (one per step) a stream may have waiting that its client has "
                   "not taken, for over a second; then the request is aborted, its slots freed")
    p.add_argument("--send-stall-timeout", type=float, default=DEFAULT_SEND_STALL_TIMEOUT_S,
                   help="seconds a client may take no response bytes while the server has more "
                   "for it; then it is disconnected and its requests aborted")
    p.add_argument("--send-buffer-bytes", type=int, default=DEFAULT_SEND_BUFFER_BYTES,
                   help="each connection's kernel send buffer (SO_SNDBUF): how much a client "
                   "that does not read can leave unsent before --max-stream-backlog counts")


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed flags; ignored vLLM options warn as LLM() does."""
    return EngineArgs.from_cli_args(args, args.model or DEFAULT_MODEL, honored=HONORED_VLLM_ARGS,
                                    usage_context="api_server",
                                    reasoning_parser=_reasoning_parser(args))


def _reasoning_parser(args: argparse.Namespace) -> Optional[str]:
    """--reasoning-parser, else the one a --chat-template file implies (logged); None lets the
    engine pick from the model's own template."""
    if args.reasoning_parser is not None or args.chat_template is None:
        return args.reasoning_parser
    from pagedllm.entrypoints.openai.api_server import load_chat_template

    picked = parser_for_template(load_chat_template(args.chat_template))
    if picked:
        logger.info("reasoning: using the %r parser (the --chat-template's <think> tags); "
                    "--reasoning-parser overrides it", picked)
    return picked or "none"


def _tool_parser(args: argparse.Namespace, template: Optional[str]) -> Optional[str]:
    """--tool-call-parser, else the parser the chat template implies (logged), else None."""
    from pagedllm.entrypoints.openai.tool_parsers import parser_for_template

    if args.tool_call_parser:
        return args.tool_call_parser
    picked = parser_for_template(template)
    if picked:
        logger.info("tool calls: using the %r parser (the chat template's tool format); "
                       "--tool-call-parser overrides it", picked)
    elif args.enable_auto_tool_choice:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the chat template "
                         "shows no tool-call format to pick one from")
    return picked


def _auto_tool_choice(args: argparse.Namespace, parser: Optional[str]) -> bool:
    """Whether tool_choice "auto" is served: the flag when given, else on once a parser is known
    (vLLM needs the flag; a quickstart server with a tool-capable template should just work)."""
    if args.enable_auto_tool_choice is not None:
        return args.enable_auto_tool_choice
    if parser is not None:
        logger.info('tool calls: tool_choice "auto" is on (the %r parser); '
                    "--no-enable-auto-tool-choice turns it off", parser)
    return parser is not None


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, taken before the model loads so that a busy port is
    refused at once rather than after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r} is not an address of this machine: "
                         f"{err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT socket is no owner
    try:
        sock.bind(address)
        # listening now holds the port (two bound, unlistened SO_REUSEADDR sockets may share
        # it); clients that connect during the load wait in the backlog
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is already in use (another server?); "
                                 "pass --port with a free port or stop the other process") \
                from None
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sock


def stats_interval() -> float:
    """Seconds between throughput lines: the first of STATS_INTERVAL_ENV_VARS set, else 10."""
    for var in STATS_INTERVAL_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            try:
                seconds = float(value)
            except ValueError:
                seconds = 0.0
            if seconds <= 0:
                raise ValueError(f"{var}={value!r} must be a positive number of seconds")
            return seconds
    return 10.0


def banner(name: str, host: str, port: int, api_key: Optional[str]) -> str:
    """Where the server listens and how to call it."""
    base = f"http://{host}:{port}/v1"
    return (f"pagedllm serving {name!r} at {base}\n"
            f"  curl {base}/chat/completions -H 'Content-Type: application/json'"
            + (" -H 'Authorization: Bearer $PAGEDLLM_API_KEY'" if api_key else "")
            + f" -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
            "\"content\": \"Hello!\"}]}'\n"
            f"  or: OpenAI(base_url=\"{base}\", api_key=\"{'KEY' if api_key else 'EMPTY'}\")")


def run_serve(args: argparse.Namespace) -> int:
    """Bind the port (a busy one is refused before anything is imported or loaded), then build
    the engine and serve until interrupted."""
    interval = stats_interval()
    limits = HttpLimits(args.max_request_body_bytes, args.request_read_timeout,
                        args.send_stall_timeout, args.send_buffer_bytes)
    slots = SlotLimits(args.max_client_share, args.max_stream_backlog)
    sock = bind_port(args.host, args.port)
    try:
        return _serve(args, sock, interval, limits, slots)
    finally:
        gc.enable()
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket, interval: float,
           limits: HttpLimits, slots: SlotLimits) -> int:
    """Load the model and run the app on `sock` until interrupted; 1 if the engine stopped."""
    # No cyclic collections while the modules and the model load: they found nothing to free
    # and took ~0.35 s of a 3 s start. What start-up made is then frozen (out of every later
    # collection's scan) and collections resume before the first request.
    gc.disable()
    eargs = engine_args(args)  # bad values refused before the engine (and torch) is imported
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.drain import drain
    from pagedllm.entrypoints.openai.api_server import build_app, load_chat_template
    from pagedllm.entrypoints.openai.bounded_http import uvicorn_options
    from pagedllm.entrypoints.openai.client_share import ClientShares
    from pagedllm.entrypoints.openai.request_log import OutputListeners, RequestLog
    from pagedllm.entrypoints.openai.serving_common import ServerContext

    chat_template = load_chat_template(args.chat_template)
    store = ResponseStore(args.responses_store_max_entries, args.responses_store_max_bytes)
    name = args.served_model_name or args.model or DEFAULT_MODEL
    adapters = lora_modules(args.lora_modules, eargs.enable_lora, name)
    engine = LLMEngine.from_engine_args(eargs)
    for adapter in adapters.values():  # refused (exit 1, naming the tensor) before serving
        engine.adapters.check(adapter)
    parser = _tool_parser(args, chat_template or getattr(engine.tokenizer, "chat_template", None))
    ctx = ServerContext(AsyncLLM(engine, max_waiting=args.max_waiting,
                                 max_stream_backlog=slots.max_stream_backlog), [name],
                        engine.config.scheduler.max_model_len, chat_template, parser,
                        _auto_tool_choice(args, parser), args.exclude_tools_when_tool_choice_none,
                        ClientShares(slots.max_client_share,
                                     engine.config.scheduler.max_num_seqs, args.max_waiting),
                        engine.input_processor.reasoning, store, adapters)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
    app = build_app(ctx, api_key, limits)
    request_log = RequestLog(log_requests=not args.disable_log_requests)
    ctx.engine.listener = OutputListeners([ctx.engine.listener, request_log])  # + /metrics
    stats = None if args.disable_log_stats else functools.partial(
        request_log.log_stats_every, interval, ctx.engine.stats)
    server = _Server(uvicorn.Config(app, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=5, **uvicorn_options(limits)),
                     banner(name, args.host, args.port, api_key), stats,
                     on_started=functools.partial(ctx.engine.warm_up_grammars,
                                                  busy=ctx.tokens.busy),
                     on_shutdown=ctx.engine.shutdown,
                     drain=functools.partial(drain, ctx.engine, args.shutdown_timeout))
    # an engine that stopped cannot recover: shut down and exit non-zero, so a supervisor
    # (systemd, Kubernetes) restarts the server
    ctx.engine.on_fatal = lambda err: setattr(server, "should_exit", True)
    gc.freeze()
    gc.enable()
    try:
        server.run(sockets=[sock])
    finally:
        ctx.engine.shutdown()
    if ctx.engine.error is not None:
        print(f"pagedllm serve: the engine stopped: {ctx.engine.error!r}; exiting with status 1",
              file=sys.stderr)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server that prints the banner once it listens, calls `on_started` (work that
    need not delay readiness), runs `background` (the throughput line) while it serves, runs
    `drain` (entrypoints/drain.py) before it stops serving, and calls `on_shutdown` once it
    has stopped."""

    def __init__(self, config: uvicorn.Config, banner_text: str,
                 background: Optional[Callable[[], Awaitable[None]]],
                 on_started: Optional[Callable[[], None]] = None,
                 on_shutdown: Optional[Callable[[], None]] = None,
                 drain: Optional[Callable[[Callable[[], bool]], Awaitable[None]]] = None) -> None:
        super().__init__(config)
        self.banner_text = banner_text
        self.background = background
        self.on_started = on_started
        self.on_shutdown = on_shutdown
        self.drain = drain
        self._task: Optional[asyncio.Future] = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM:
            # drained, then a normal exit with serve's own status: uvicorn would re-raise the
            # signal once run() ends (exit 143)
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Optional[list[socket.socket]] = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        print(self.banner_text, file=sys.stderr, flush=True)
        if self.on_started is not None:
            self.on_started()
        if self.background is not None:
            self._task = asyncio.ensure_future(self.background())

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.drain is not None:  # still listening: new requests are answered 503
            await self.drain(lambda: self.force_exit)
        await super().shutdown(sockets=sockets)
        if self.on_shutdown is not None:
            # here, not after run(): on SIGTERM uvicorn re-raises the signal once run() ends,
            # which kills the process before the caller's clean-up (worker processes included)
            self.on_shutdown()
