"""Time from starting `pagedllm serve MODEL` until GET /health answers 200.

    python benchmarks/bench_serve_ready.py MODEL [RUNS]

MODEL is anything `serve` takes: a shipped name, or a .gguf by path (copy a shipped GGUF into a
temporary folder to time a GGUF the model store does not know: its tokenizer is built from the
file's metadata on the first start and read from the cache after). Prints each run's seconds
and the minimum."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def once(model: str) -> float:
    """Seconds until /health answered 200."""
    port = _free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model,
                             "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with status {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except OSError:
                time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    model = sys.argv[1]
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    times = [once(model) for _ in range(runs)]
    print(f"{model}: ready in " + " ".join(f"{t:.2f}" for t in times)
          + f" s (min {min(times):.2f} s)")


if __name__ == "__main__":
    main()
