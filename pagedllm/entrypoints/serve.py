"""`pagedllm serve`: load the model, start the OpenAI-compatible server, say how to call it."""
from __future__ import annotations

import argparse
from typing import Optional

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT_S
import logging
import os
import sys

from pagedllm.loader.model_store import DEFAULT_MODEL

logger = logging.getLogger("pagedllm")


def add_serve_parser(sub) -> None:
    """The `serve` sub-command's flags (vLLM's names)."""
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Serve MODEL over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a .gguf file, an HF directory, or a known name (default {DEFAULT_MODEL})")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit")
    p.add_argument("--gguf-file", default=None, help="a .gguf file inside a Hub repo")
    p.add_argument("--model-source", default=None, choices=["huggingface", "modelscope"],
                   help="where Hub ids are fetched from (PAGEDLLM_USE_MODELSCOPE=1 also selects "
                   "ModelScope)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="name clients send as `model`")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="default: a GGUF keeps its quantized blocks on the CPU; int8/int4 "
                   "quantize a float checkpoint at load; none dequantizes")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every "
                   "endpoint but /health, /metrics, /version and the API docs (or set "
                   "PAGEDLLM_API_KEY)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests with tools use tool_choice "auto" (needs a tool-call parser)')
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are read from the output (default: the one the chat "
                   "template implies, if any)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='do not render tools in the prompt when tool_choice is "none"')
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond this get HTTP 503")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get HTTP 413, refused while being read")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="seconds the server waits on a client's request headers or body "
                   "bytes; then 408 or the connection is closed")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


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
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser: the chat template "
                         "shows no tool-call format to pick one from")
    return picked


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine and run uvicorn until interrupted."""
    import uvicorn

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app, load_chat_template
    from pagedllm.entrypoints.openai.bounded_http import uvicorn_options
    from pagedllm.entrypoints.openai.limits import HttpLimits
    from pagedllm.entrypoints.openai.serving_common import ServerContext

    chat_template = load_chat_template(args.chat_template)
    try:
        limits = HttpLimits(args.max_request_body_bytes, args.request_read_timeout)
    except ValueError as err:
        raise SystemExit(f"pagedllm serve: {err}") from None
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        revision=args.revision, gguf_file=args.gguf_file, model_source=args.model_source,
        quantization=args.quantization, usage_context="api_server"))
    name = args.served_model_name or args.model
    parser = _tool_parser(args, chat_template or getattr(engine.tokenizer, "chat_template", None))
    ctx = ServerContext(AsyncLLM(engine, max_waiting=args.max_waiting), [name],
                        engine.config.scheduler.max_model_len, chat_template, parser,
                        args.enable_auto_tool_choice, args.exclude_tools_when_tool_choice_none)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
    base = f"http://{args.host}:{args.port}/v1"
    print(f"pagedllm serving {name!r} at {base}\n"
          f"  curl {base}/chat/completions -H 'Content-Type: application/json'"
          + (" -H 'Authorization: Bearer $PAGEDLLM_API_KEY'" if api_key else "")
          + f" -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
          "\"content\": \"Hello!\"}]}'\n"
          f"  or: OpenAI(base_url=\"{base}\", api_key=\"{'KEY' if api_key else 'EMPTY'}\")",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(
        build_app(ctx, api_key, limits), host=args.host, port=args.port,
        log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5,
        **uvicorn_options(limits)))
    # an engine that stopped cannot recover: shut down and exit non-zero, so a supervisor
    # (systemd, Kubernetes) restarts the server
    ctx.engine.on_fatal = lambda err: setattr(server, "should_exit", True)
    server.run()
    ctx.engine.shutdown()
    if ctx.engine.error is not None:
        print(f"pagedllm serve: the engine stopped: {ctx.engine.error!r}; exiting with status 1",
              file=sys.stderr)
        return 1
    return 0
