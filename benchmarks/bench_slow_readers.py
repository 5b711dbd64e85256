"""Slow readers against a real `pagedllm serve` (loopback): streaming clients that send a request
and never read their socket, then one normal streaming request. Prints the normal request's time
to its first token, the server's RSS over the run and the abort lines of its log.

    .venv/bin/python benchmarks/bench_slow_readers.py [--readers 4] [--n 4] [--max-num-seqs 16]
        [--duration 40] [-- extra serve flags]

Each non-reader asks for n samples of max_tokens tokens with echo, logprobs 20 and ignore_eos
(the issue's load: 16 such clients, n=4, held all 64 slots). Every loop here is bounded by
--duration; the server is stopped at the end."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, model: str, extra: list[str], log) -> subprocess.Popen:
    """`pagedllm serve` on port; returns once /health answers 200 (or raises)."""
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model,
                             "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not healthy in 180 s")


def non_reader(port: int, body: dict, source: str = "127.0.0.1") -> socket.socket:
    """A socket that has sent a streaming request and will never read its answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def first_token_seconds(url: str, model: str, timeout: float) -> float:
    """Seconds from sending a normal streaming request to its first text chunk; inf if none."""
    started = time.monotonic()
    body = {"model": model, "prompt": "Hello, my name is", "max_tokens": 8, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    return time.monotonic() - started
    except httpx.HTTPError:
        pass
    return float("inf")


def rss_mb(pid: int) -> float:
    """Resident set size of pid in MB."""
    with open(f"/proc/{pid}/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS:")) / 1024


def main() -> None:
    """Run the load once and print what was measured."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4000)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--delay", type=float, default=5.0, help="seconds before the normal request")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--reader-address", default="127.0.0.1", help="the non-readers' source "
                    "address (127.0.0.2: another client than the normal request's 127.0.0.1)")
    ap.add_argument("extra", nargs="*", help="more `serve` flags (after --)")
    args = ap.parse_args()
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="slow-readers-", suffix=".log", delete=False)
    proc = start_server(port, args.model, ["--max-num-seqs", str(args.max_num_seqs),
                                           *args.extra], log)
    try:
        _run(args, port, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.seek(0)
        lines = log.readlines()
        for line in [l for l in lines if "throughput" in l][:8]:
            print("  " + line.rstrip())
        aborts = [l.rstrip() for l in lines if "aborted" in l or "disconnected" in l]
        print(f"abort lines in the log: {len(aborts)}")
        for line in aborts[:3]:
            print("  " + line)
        os.unlink(log.name)


def _run(args: argparse.Namespace, port: int, proc: subprocess.Popen) -> None:
    url = f"http://127.0.0.1:{port}"
    body = {"model": args.model, "prompt": "Tell me a long story about " * 8, "n": args.n,
            "max_tokens": args.max_tokens, "echo": True, "logprobs": 20, "stream": True,
            "ignore_eos": True}
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    socks = [non_reader(port, body, args.reader_address) for _ in range(args.readers)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            samples.append((time.monotonic() - started, rss_mb(proc.pid)))

    rss_before = rss_mb(proc.pid)
    threading.Thread(target=sample, daemon=True).start()
    time.sleep(args.delay)
    ttft = first_token_seconds(url, args.model, args.duration)
    print(f"normal request sent at {args.delay:.0f} s: first token after {ttft:.2f} s")
    while time.monotonic() - started < args.duration:
        time.sleep(0.5)
    stop.set()
    marks = [f"{r:.0f} MB at {t:.0f} s" for t, r in samples[9::10]]
    print(f"server RSS: {rss_before:.0f} MB before; " + ", ".join(marks))
    health = httpx.get(f"{url}/health", timeout=5).status_code
    print(f"/health at the end: {health}")
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()
