"""Regenerate README's headline figures table (pagedllm's column; the peers' when given).

    PYTHONPATH=. .venv/bin/python benchmarks/readme_figures.py [--model NAME] [--repeats 3]
        [--llama-bench PATH [--gguf FILE]] [--vllm-url URL] [--skip-serve]

pagedllm's rows, each `--repeats` times (a range when they differ):
  - prompt processing, 512 tokens:  pagedllm bench latency --input-len 512 (prefill_tok_per_s)
  - one-stream decode, short context: pagedllm bench latency --input-len 16 (decode_tok_per_s)
  - offline 32 x (100 + 128):        pagedllm bench throughput --num-prompts 32 --input-len 100
                                     --output-len 128 (output_tok_per_s)
  - server, 48 at concurrency 16:    pagedllm serve MODEL, then pagedllm bench serve
                                     --num-prompts 48 --max-concurrency 16 (output tok/s, TTFT p50)
--llama-bench PATH runs `llama-bench -m GGUF -p 512 -n 128 -t 2 -o json` (the model's GGUF from
the model store unless --gguf) for its pp512 and tg128; --vllm-url URL runs the same `bench
serve` against a running vLLM server. Peer cells are blank otherwise. Prints the table in
README's markdown form, headed by the date, the CPU model and its ISA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("pagedllm", "llama.cpp", "vllm")


@dataclass(frozen=True)
class Row:
    """One row of the table: its label, the unit pagedllm's cell carries, and the JSON key."""

    label: str
    unit: str


ROWS = {
    "prefill": Row("prompt processing, 512 tokens", "tok/s"),
    "decode": Row("one-stream decode, short context", "tok/s"),
    "offline": Row("offline 32 x (100 + 128), output tok/s", ""),
    "serve": Row("server, 48 requests at concurrency 16, output tok/s", ""),
    "ttft": Row("server, time to first token p50", "s"),
}


@dataclass
class Figures:
    """Measured values per (row, engine): several runs each, shown as a range."""

    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, row: str, engine: str, value: float) -> None:
        """Record one run's value."""
        if row not in ROWS or engine not in PEERS:
            raise ValueError(f"row must be one of {sorted(ROWS)} and engine one of {PEERS}; "
                             f"got {row!r}, {engine!r}")
        self.values.setdefault((row, engine), []).append(value)


def cell(values: Sequence[float], unit: str = "") -> str:
    """'lo-hi unit' (one value: 'v unit'; none: blank), 1 decimal, 2 for seconds."""
    if not values:
        return ""
    digits = 2 if unit == "s" else 1
    lo, hi = min(values), max(values)
    text = f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else \
        f"{lo:.{digits}f}-{hi:.{digits}f}"
    return f"{text} {unit}".rstrip()


def table(figures: Figures, model: str, cpu: str, isa: Sequence[str], date: str,
          threads: int = 2) -> str:
    """README's headline figures paragraph and table for these figures."""
    head = (f"Default model ({model}), {threads} threads, llama.cpp and vLLM's CPU build run side "
            f"by side in the same sitting, on {cpu} ({', '.join(isa)}), {date}:")
    lines = [head, "", "| | pagedllm | llama.cpp (same GGUF) | vLLM CPU (bf16) |",
             "|---|---|---|---|"]
    for key, row in ROWS.items():
        cells = [cell(figures.values.get((key, "pagedllm"), []), row.unit)]
        cells += [cell(figures.values.get((key, peer), []), "s" if row.unit == "s" else "")
                  for peer in PEERS[1:]]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _bench(mode: str, args: list[str]) -> dict:
    """One `pagedllm bench` run in its own process; its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", mode, *args,
                        "--output-json", out.name], check=True, env=_env(),
                       stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def _serve_bench(url: str) -> dict:
    return _bench("serve", ["--url", url, "--num-prompts", "48", "--max-concurrency", "16"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_server(model: str) -> dict:
    """Start `pagedllm serve`, wait for /health, run the serve bench, stop it."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model,
                             "--port", str(port)], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pagedllm serve did not come up (status {proc.poll()})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        return _serve_bench(f"http://127.0.0.1:{port}/v1")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def measure_pagedllm(figures: Figures, model: str, serve: bool) -> dict:
    """One run of each pagedllm row; returns the machine the bench recorded."""
    r = _bench("latency", ["--model", model, "--input-len", "512", "--output-len", "16"])
    figures.add("prefill", "pagedllm", r["prefill_tok_per_s"])
    r = _bench("latency", ["--model", model, "--input-len", "16", "--output-len", "128"])
    figures.add("decode", "pagedllm", r["decode_tok_per_s"])
    r = _bench("throughput", ["--model", model, "--num-prompts", "32", "--input-len", "100",
                              "--output-len", "128"])
    figures.add("offline", "pagedllm", r["output_tok_per_s"])
    if serve:
        s = _with_server(model)
        figures.add("serve", "pagedllm", s["output_tok_per_s"])
        figures.add("ttft", "pagedllm", s["ttft_p50_s"])
    return r["machine"]


def llama_bench_figures(output: str) -> dict[str, float]:
    """pp512 and tg128 tok/s from `llama-bench -o json` output."""
    found = {}
    for test in json.loads(output):
        if test.get("n_prompt") == 512 and not test.get("n_gen"):
            found["prefill"] = float(test["avg_ts"])
        elif test.get("n_gen") == 128 and not test.get("n_prompt"):
            found["decode"] = float(test["avg_ts"])
    return found


def measure_llama(figures: Figures, binary: str, gguf: str) -> None:
    """One llama-bench run (2 threads)."""
    out = subprocess.run([binary, "-m", gguf, "-p", "512", "-n", "128", "-t", "2", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    for row, value in llama_bench_figures(out).items():
        figures.add(row, "llama.cpp", value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, metavar="PATH")
    ap.add_argument("--gguf", default=None, help="the GGUF for llama-bench (default: the model "
                    "store's file of --model)")
    ap.add_argument("--vllm-url", default=None, metavar="URL")
    ap.add_argument("--skip-serve", action="store_true", help="leave the server rows out")
    args = ap.parse_args()
    figures, machine = Figures(), None
    gguf = args.gguf
    if args.llama_bench and gguf is None:
        from pagedllm.hub.model_store import ensure_gguf

        gguf = str(ensure_gguf(args.model))
    for _ in range(args.repeats):  # engines alternate, so a busy spell hits each alike
        machine = measure_pagedllm(figures, args.model, not args.skip_serve)
        if args.llama_bench:
            measure_llama(figures, args.llama_bench, gguf)
        if args.vllm_url:
            s = _serve_bench(args.vllm_url)
            figures.add("serve", "vllm", s["output_tok_per_s"])
            figures.add("ttft", "vllm", s["ttft_p50_s"])
    print(table(figures, args.model, machine["cpu"], machine["isa"],
                datetime.date.today().isoformat(), machine["threads"]))


if __name__ == "__main__":
    main()
