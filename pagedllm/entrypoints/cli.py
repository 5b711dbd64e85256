"""The `pagedllm` command line.

A refusal (a model that is missing or does not fit, a busy port, a bad value, ...) is one
message on stderr, with the ways out where it has some, and exit status 1; a usage error is one
line and exit status 2. --debug or PAGEDLLM_LOGGING_LEVEL=DEBUG shows the traceback instead.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable, NoReturn, Optional

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.bench import add_bench_parser, run_bench
from pagedllm.entrypoints.chat_cli import add_client_parsers, run_chat, run_complete
from pagedllm.entrypoints.models_cli import (add_models_parsers, run_list, run_pull, run_rm,
                                             run_run)
from pagedllm.entrypoints.serve import add_serve_parser, run_serve
from pagedllm.logger import DATE_FORMAT, LOG_FORMAT, env_level
from pagedllm.version import __version__


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with each flag's default (a flag whose default is None says in its own words what
    happens when it is left out; an on/off switch is off unless given); descriptions keep their
    line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (--model must not mean --model-source), help with defaults, a usage
    error in one line, and --debug before or after any sub-command (as -h is)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # SUPPRESS: a sub-command's parser leaves a --debug given before it in place
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="log at DEBUG and show the traceback of an error (also: "
                          "PAGEDLLM_LOGGING_LEVEL=DEBUG)")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """Parser with one sub-command per job."""
    parser = Parser(prog="pagedllm", description="pagedllm: a vLLM-compatible LLM engine for "
                    "the device this machine has")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.set_defaults(commands=sub.choices)  # for an unknown flag's error to name its command
    add_serve_parser(sub)
    add_client_parsers(sub)
    add_models_parsers(sub)
    add_bench_parser(sub)
    doctor = sub.add_parser("doctor", help="report this machine and whether MODEL fits",
                            description="Report device probes, CPU, memory and, for MODEL, "
                            "whether and how it fits.\nReads metadata only.")
    doctor.add_argument("model", nargs="?", help="a .gguf file, an HF directory, a Hub id or a "
                        "known name (default: none, the machine only)")
    doctor.add_argument("--json", action="store_true", help="print JSON for scripts")
    EngineArgs.add_cli_args(doctor, names=("dtype", "device", "max_model_len",
                                           "speculative_config"))
    return parser


def _run_doctor(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.doctor import run

    return run(args.model, args.json, args.device, args.dtype, args.max_model_len,
               args.speculative_config)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": run_serve, "chat": run_chat, "complete": run_complete, "bench": run_bench,
    "doctor": _run_doctor, "pull": run_pull, "list": run_list, "rm": run_rm, "run": run_run}


# commands that load the model they are given in this process (bench serve asks a server)
LOADS_MODEL = ("serve", "run", "doctor", "bench")


def check_model_reference(args: argparse.Namespace) -> None:
    """ValueError for a model that names nothing loadable, before the command imports torch and
    the engine (~2-4 s): a refusal prints within a second, as the loader's own would later."""
    model = getattr(args, "model", None)
    if args.command not in LOADS_MODEL or not model or getattr(args, "mode", None) == "serve":
        return
    from pagedllm.hub.sources import unknown_reference

    unknown = unknown_reference(model, getattr(args, "revision", None),
                                getattr(args, "gguf_file", None))
    if unknown is not None:
        raise ValueError(unknown)


def refusal_message(err: BaseException) -> Optional[str]:
    """The message of an error the user can act on (printed without a traceback), or None for
    one that is a bug. The one list of what the loader, the Hub, the planner, the kernels and
    the command line raise: ValueError (bad values, models not found or corrupt, the memory
    planner's "does not fit" with its ways out), HubError (not cached offline, gated,
    unreachable), KernelBuildError, OSError (busy port, unreadable file, server down)."""
    from pagedllm.hub.hub import HubError

    # KernelBuildError comes only from an imported pagedllm.kernels; importing it here would
    # load torch for a `chat --url` that never needed it
    kernels = sys.modules.get("pagedllm.kernels")
    kinds = (ValueError, HubError, OSError) + ((kernels.KernelBuildError,) if kernels else ())
    return (str(err) or type(err).__name__) if isinstance(err, kinds) else None


def _configure_logging(args: argparse.Namespace, debug: bool) -> None:
    """Root at WARNING; pagedllm at DEBUG (--debug), else the environment's level, else INFO for
    `serve` (its request and throughput lines) and WARNING for the rest."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, datefmt=DATE_FORMAT)
    default = logging.INFO if args.command == "serve" else logging.WARNING
    level = logging.DEBUG if debug else env_level()
    logging.getLogger("pagedllm").setLevel(default if level is None else level)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `pagedllm` script."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    debug = getattr(args, "debug", False)
    prog = f"pagedllm {args.command}"
    try:
        debug = debug or env_level() == logging.DEBUG
        _configure_logging(args, debug)
        check_model_reference(args)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - a refusal is one message; a bug keeps its traceback
        message = None if debug else refusal_message(err)
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
