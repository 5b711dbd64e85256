"""bf16 x8 matmuls with their weights streamed from memory, as in a decode step: each of the
default model's layer shapes over 24 distinct random weights (one per layer), after a 160 MB
write that leaves none of them in a cache, against the same 24 calls on one weight (from the
caches).

    .venv/bin/python benchmarks/bench_bf16_cold.py [--rows 32] [--variant avx512bf16]

Prints per shape the ms a call (best of 6 rounds) and GFLOP/s, from memory and from the caches,
and the sum over a layer's four shapes. The engine's gate and up are two weights of one call; here
gate_up is one weight of 9,728 rows, so at prompt sizes (--rows 1067) its 41 MB output is
past the allocator's 32 MiB reuse threshold and its figure includes that output's page faults.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm.kernels import load_kernels
from pagedllm.platforms.malloc import keep_freed_memory

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
LAYERS = 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="x rows (32: the offline run's decode)")
    ap.add_argument("--variant", default="avx512bf16", help="bf16 x8 variant (bf16_kernels())")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    keep_freed_memory()  # as the engine does
    load_kernels()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = torch.ops.pagedllm
    m = args.rows
    flush = torch.empty(40_000_000)
    total_cold = total_hot = 0.0
    for name, (n, k) in SHAPES.items():
        ws = [ops.bf16_pack_x8((torch.randn(n, k) * 0.05).to(torch.bfloat16)) for _ in range(LAYERS)]
        x = torch.randn(m, k)
        cold = hot = float("inf")
        for _ in range(6):
            flush.fill_(1.0)
            t = time.perf_counter()
            for w in ws:
                ops.bf16_linear_x8(x, w, k, args.variant)
            cold = min(cold, (time.perf_counter() - t) / LAYERS)
            t = time.perf_counter()
            for _ in range(LAYERS):
                ops.bf16_linear_x8(x, ws[0], k, args.variant)
            hot = min(hot, (time.perf_counter() - t) / LAYERS)
        flop = 2.0 * m * n * k
        total_cold += cold
        total_hot += hot
        print(f"{name:8s} m={m}: from memory {cold * 1e3:.3f} ms {flop / cold / 1e9:5.0f} GFLOP/s | "
              f"from the caches {hot * 1e3:.3f} ms {flop / hot / 1e9:5.0f} GFLOP/s", flush=True)
    print(f"a layer's four: from memory {total_cold * 1e3:.3f} ms, from the caches {total_hot * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
