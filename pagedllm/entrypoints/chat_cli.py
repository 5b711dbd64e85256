"""`pagedllm chat` (interactive, multi-turn) and `pagedllm complete` (one shot)."""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Optional

from pagedllm.loader.model_store import DEFAULT_MODEL


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running OpenAI-compatible server, e.g. "
                   "http://127.0.0.1:8000/v1 (default: run the model in this process)")
    p.add_argument("--model", default=None, help=f"model name (server) or path/name to load "
                   f"in-process (default {DEFAULT_MODEL})")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--device", default="auto", help="in-process only")


def add_client_parsers(sub) -> None:
    """`chat` and `complete` sub-commands."""
    chat = sub.add_parser("chat", help="chat in the terminal (Ctrl-C stops a reply, Ctrl-D quits)")
    _add_backend_flags(chat)
    chat.add_argument("--system", default=None, help="a system prompt")
    complete = sub.add_parser("complete", help="complete a prompt from an argument or stdin")
    complete.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    _add_backend_flags(complete)


def _catch_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt even when started with SIGINT ignored (e.g. as a
    background job), because here it means "stop this reply"."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _backend(args: argparse.Namespace):
    from pagedllm.entrypoints.client_backends import LocalBackend, ServerBackend

    if args.url:
        return ServerBackend(args.url, args.api_key, args.model)
    print(f"loading {args.model or DEFAULT_MODEL} ...", file=sys.stderr, flush=True)
    return LocalBackend(args.model or DEFAULT_MODEL, device=args.device)


def run_complete(args: argparse.Namespace) -> int:
    """Stream one completion to stdout."""
    _catch_ctrl_c()
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        print("pagedllm complete: empty prompt", file=sys.stderr)
        return 2
    backend = _backend(args)
    try:
        for piece in backend.complete(prompt, args.max_tokens or 256, args.temperature):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    sys.stdout.write("\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat with streaming replies."""
    _catch_ctrl_c()
    backend = _backend(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("chat ready — Ctrl-C stops a reply, Ctrl-D or /exit quits", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = _stream_reply(backend, history, args)
        history.append({"role": "assistant", "content": reply})


def _stream_reply(backend, history: list[dict[str, str]], args: argparse.Namespace) -> str:
    pieces: list[str] = []
    stream = None
    try:
        stream = backend.chat(history, args.max_tokens, args.temperature)
        for piece in stream:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        close: Optional[object] = getattr(stream, "close", None)
        if callable(close):
            close()
        sys.stdout.write(" [stopped]")
    except (RuntimeError, ConnectionError) as err:
        sys.stdout.write(f"\n[error: {err}]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)
