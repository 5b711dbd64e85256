"""The `pagedllm` command line."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from pagedllm.entrypoints.bench import add_bench_parser, run_bench
from pagedllm.entrypoints.chat_cli import add_client_parsers, run_chat, run_complete
from pagedllm.entrypoints.serve import add_serve_parser, run_serve
from pagedllm.version import __version__


def build_parser() -> argparse.ArgumentParser:
    """Parser with one sub-command per job."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: a vLLM-compatible "
                                     "LLM engine for the device this machine has")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_client_parsers(sub)
    add_bench_parser(sub)
    doctor = sub.add_parser("doctor", help="report this machine and whether MODEL fits",
                            description="Report device probes, CPU, memory and, for MODEL, "
                            "whether and how it fits. Reads metadata only.")
    doctor.add_argument("model", nargs="?", help="a .gguf file, an HF directory, or a known name")
    doctor.add_argument("--json", action="store_true", help="print JSON for scripts")
    doctor.add_argument("--device", default=None, help="auto, cpu, cuda, rocm, xpu, mps")
    doctor.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    doctor.add_argument("--max-model-len", type=int, default=None)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `pagedllm` script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        logging.getLogger("pagedllm").setLevel(logging.INFO)
        return run_serve(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "chat":
        return run_chat(args)
    if args.command == "complete":
        return run_complete(args)
    if args.command == "doctor":
        from pagedllm.entrypoints.doctor import run

        try:
            return run(args.model, args.json, args.device, args.dtype, args.max_model_len)
        except (ValueError, FileNotFoundError) as err:
            print(f"pagedllm doctor: {err}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
