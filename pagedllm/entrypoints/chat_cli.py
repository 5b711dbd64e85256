"""`pagedllm chat` (interactive, multi-turn) and `pagedllm complete` (one shot)."""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Optional

from pagedllm.engine.arg_utils import EngineArgs, cli_fields
from pagedllm.hub.model_store import DEFAULT_MODEL

CHAT_HELP = """commands (never sent to the model):
  /help   this list
  /clear  forget the conversation (the --system prompt stays)
  /bye    quit (also /exit, /quit, Ctrl-D)
Ctrl-C stops a reply and keeps the chat going."""
QUIT_COMMANDS = ("/bye", "/exit", "/quit")  # /bye as in Ollama


def _add_backend_flags(p: argparse.ArgumentParser, default_max_tokens: Optional[int]) -> None:
    p.add_argument("--url", default=None, help="a running OpenAI-compatible server, e.g. "
                   "http://127.0.0.1:8000/v1 (default: run the model in this process)")
    p.add_argument("--model", default=None, help="model name on the server, or path/name to "
                   f"load in-process (default: the server's first model, or {DEFAULT_MODEL})")
    p.add_argument("--api-key", default=None, help="the server's key (default: no key)")
    add_reply_flags(p, default_max_tokens)
    EngineArgs.add_cli_args(p, title="in-process engine (without --url)")


def add_reply_flags(p: argparse.ArgumentParser, default_max_tokens: Optional[int]) -> None:
    """--max-tokens and --temperature: how an in-process or served reply is made."""
    p.add_argument("--max-tokens", type=int, default=default_max_tokens,
                   help="most tokens per reply" + ("" if default_max_tokens else
                                                   " (default: up to the context length)"))
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")


def add_client_parsers(sub) -> None:
    """`chat` and `complete` sub-commands."""
    chat = sub.add_parser("chat", help="chat in the terminal (Ctrl-C stops a reply, Ctrl-D quits)",
                          description="Chat with MODEL in the terminal.\n\n" + CHAT_HELP)
    _add_backend_flags(chat, None)
    chat.add_argument("--system", default=None, help="a system prompt (default: none)")
    complete = sub.add_parser("complete", help="complete a prompt from an argument or stdin")
    complete.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    _add_backend_flags(complete, 256)


def catch_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt even when started with SIGINT ignored (e.g. as a
    background job), because here it means "stop this reply"."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _backend(args: argparse.Namespace):
    from pagedllm.entrypoints.client_backends import LocalBackend, ServerBackend

    if args.url:
        _refuse_engine_flags(args)
        return ServerBackend(args.url, args.api_key, args.model)
    engine_args = EngineArgs.from_cli_args(args, args.model or DEFAULT_MODEL)  # bad values: now
    print(f"loading {engine_args.model} ...", file=sys.stderr, flush=True)
    return LocalBackend(engine_args)


def _refuse_engine_flags(args: argparse.Namespace) -> None:
    """A ValueError naming the in-process engine's flags given with --url: the server's own
    settings apply there, so such a flag would have no effect."""
    given = ["--" + f.name.replace("_", "-") for f in cli_fields()
             if getattr(args, f.name) != f.default]
    if given:
        raise ValueError(f"{', '.join(given)} set up the in-process engine, which --url does "
                         "not start (the server's own settings apply): drop them or --url")


def run_complete(args: argparse.Namespace) -> int:
    """Stream one completion to stdout."""
    catch_ctrl_c()
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise ValueError("the prompt is empty: pass PROMPT or send it on stdin")
    backend = _backend(args)
    try:
        for piece in backend.complete(prompt, args.max_tokens, args.temperature):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    sys.stdout.write("\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat with streaming replies."""
    catch_ctrl_c()
    return chat_loop(_backend(args), args)


def chat_loop(backend, args: argparse.Namespace) -> int:
    """Read lines from stdin and stream each reply to stdout, keeping the conversation (with
    args.system first, if set); the quit commands or Ctrl-D end it. Also `pagedllm run`'s loop."""
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("chat ready — /help lists commands, Ctrl-C stops a reply, Ctrl-D or /bye quits",
          file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command = line.strip()
        if command in QUIT_COMMANDS:
            return 0
        if command.startswith("/") and " " not in command:
            _chat_command(command, history)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        reply = stream_reply(backend, history, args)
        history.append({"role": "assistant", "content": reply})


def _chat_command(command: str, history: list[dict[str, str]]) -> None:
    """/help or /clear (which keeps the system prompt); anything else is named as unknown. A
    line with a space, such as "/usr/bin is what?", is a message, not a command."""
    if command == "/help":
        print(CHAT_HELP, file=sys.stderr, flush=True)
    elif command == "/clear":
        del history[1 if history and history[0]["role"] == "system" else 0:]
        print("(conversation cleared)", file=sys.stderr, flush=True)
    else:
        print(f"unknown command {command}; /help lists the commands", file=sys.stderr,
              flush=True)


def stream_reply(backend, history: list[dict[str, str]], args: argparse.Namespace) -> str:
    """Stream the backend's reply to `history` onto stdout (Ctrl-C stops it); its text."""
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
