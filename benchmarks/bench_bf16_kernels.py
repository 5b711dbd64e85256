"""bf16 matmuls on the default model's shapes: pagedllm's x8 kernels against torch's bf16 and fp32.

    .venv/bin/python benchmarks/bench_bf16_kernels.py [--rows 1 8 32 128 512] [--variants avx512bf16]

For each shape (a whole layer's q/k/v, o, gate/up, down, then the head) and x row count: the bf16
x8 kernel variants (torch.ops.pagedllm.bf16_linear_x8), torch's F.linear on the bf16 matrix with
bf16 x (oneDNN; what dtype="bfloat16" runs) and on the float32 matrix (what the float32 upcast
runs). --cpu-time runs one thread timed by its own CPU seconds, for a busy machine. Times are the best of --rounds turns, each variant in a row, so that noise from other
processes falls on all alike; GFLOP/s counts 2 m n k.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedllm.kernels import load_kernels
from pagedllm.platforms.malloc import keep_freed_memory

# (name, out_features, in_features) of Qwen2.5-Coder-0.5B
SHAPES = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
          ("head", 151936, 896)]


CLOCK = [time.perf_counter]  # --cpu-time: time.thread_time (one thread: the calling thread's CPU s)


def _best(fn, rounds: int, min_s: float = 0.05) -> float:
    """Best of `rounds` rounds of calls for at least min_s each, and of the single calls."""
    fn()
    best = float("inf")
    clock = CLOCK[0]
    for _ in range(rounds):
        n, t0 = 0, clock()
        while True:
            t1 = clock()
            fn()
            best = min(best, clock() - t1)
            n += 1
            el = clock() - t0
            if el > min_s:
                break
        best = min(best, el / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--variants", nargs="+", default=None, help="bf16 x8 variants (default: all runnable)")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true",
                    help="one thread, timed by its CPU time: figures that hold on a busy machine")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's bf16 and fp32 F.linear")
    args = ap.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
        CLOCK[0] = time.thread_time
    keep_freed_memory()  # as the engine does: outputs under 32 MiB reuse the heap, not fresh pages
    load_kernels()
    ops = torch.ops.pagedllm
    variants = args.variants or [v for v in ops.bf16_kernels() if v != "scalar"]
    print(f"threads {torch.get_num_threads()}; variants {variants}")
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        wp, w32 = ops.bf16_pack_x8(w), w.float()
        for m in args.rows:
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            cands = {f"x8 {v}": (lambda v=v: ops.bf16_linear_x8(x, wp, k, v)) for v in variants}
            if not args.no_torch:
                cands["torch bf16"] = lambda: F.linear(xb, w)
                cands["torch fp32"] = lambda: F.linear(x, w32)
            times = {label: _best(fn, args.rounds) for label, fn in cands.items()}
            flop = 2.0 * m * n * k
            cells = "  ".join(f"{label} {t * 1e3:8.3f} ms {flop / t / 1e9:6.1f} GF/s" for label, t in times.items())
            print(f"{name:8s} m={m:4d}  {cells}", flush=True)


if __name__ == "__main__":
    main()
