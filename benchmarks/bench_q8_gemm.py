"""The Q8_0 x8 gemm (int8 at load) on the default model's shapes: G multiply-adds/s per thread.

    .venv/bin/python benchmarks/bench_q8_gemm.py [--rows 32 1024] [--threads 1] [--cold 24]
        [--shapes g2 qkv o gu down head] [--isa avx512vnni avx512amx] [--types q8_0 q8_0g4]

Times ggml_linear_x8 (x quantized to int8 per 32 values, then the gemm) by CPU time
(process_time: other processes do not count; with --threads 2 both threads' time), best of
--rounds. The weights stay in the cache (L3) unless --cold N cycles through N copies (each call
then streams its weights from memory, as a model's step does; the head is never copied). g2:
gate and up as the model runs them, two [4864, 896] matrices in one call; gu: one [9728, 896]
matrix. Compare with vpdpbusd's peak per thread (benchmarks/maddubs_peak.cpp). --isa: kernel
variants (default: the one this process picks), alternated round by round on each shape. --types: Q8_0, and the grouped
Q8_0 (q8_0g4: 4 blocks share a scale, x quantized per 128 values; pagedllm.kernels.types),
alternated the same way (the same int8 values; the grouped copy's scales made equal in each group).
"""
from __future__ import annotations

import argparse
import time

import torch
from gguf import GGMLQuantizationType as T

from bench_kernels import random_blocks  # benchmarks/ is the script's directory
from pagedllm.kernels import load_kernels
from pagedllm.kernels.types import Q8_0G4, Q8_GROUP_BLOCKS
from pagedllm.platforms.malloc import keep_freed_memory

# name -> (out_features, in_features, matrices in one call)
SHAPES = {"g2": (4864, 896, 2), "qkv": (1152, 896, 1), "o": (896, 896, 1), "gu": (9728, 896, 1),
          "down": (896, 4864, 1), "head": (151936, 896, 1)}


def seconds(call, min_time: float = 0.3) -> float:
    """CPU seconds a call took, over at least min_time wall seconds."""
    n, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < min_time or n < 2:
        call(n)
        n += 1
    return (time.process_time() - cpu0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 1024])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", type=int, default=0, help="copies of each matrix cycled (weights from memory)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["g2", "qkv", "o", "down", "head"], choices=list(SHAPES))
    ap.add_argument("--isa", nargs="+", default=None, help="kernel variants to alternate (kernel_isas())")
    ap.add_argument("--types", nargs="+", default=["q8_0"], choices=["q8_0", "q8_0g4"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_kernels()
    keep_freed_memory()  # as the engine does: large outputs reused, not page-faulted anew
    ops = torch.ops.pagedllm
    isas = args.isa or [ops.kernel_isa()[0]]
    for name in args.shapes:
        n, k, count = SHAPES[name]
        w = random_blocks(T.Q8_0, n, k)
        grouped = w.reshape(n, k // 32, 34).clone()
        for b in range(k // 32):
            grouped[:, b, :2] = grouped[:, b - b % Q8_GROUP_BLOCKS, :2]
        qtypes = {"q8_0": (int(T.Q8_0), w), "q8_0g4": (Q8_0G4, grouped.reshape(n, -1))}
        copies = 1 if name == "head" else max(1, args.cold)
        packs = {t: [ops.ggml_pack_x8(qtypes[t][1], qtypes[t][0], k) for _ in range(copies)] for t in args.types}
        for m in args.rows:
            x = torch.randn(m, k)
            best = {(isa, t): float("inf") for isa in isas for t in args.types}
            for _ in range(args.rounds):
                for isa, t in best:
                    ops.set_kernel_isa(isa)
                    best[isa, t] = min(best[isa, t], seconds(lambda i: ops.ggml_linear_x8(
                        x, [packs[t][i % copies]] * count, [qtypes[t][0]] * count, k)))
            for (isa, t), s in best.items():
                print(f"{name:5} {count}x{n}x{k} m={m:<5} {isa:10} {t:6} {s * 1e3:9.3f} ms  "
                      f"{count * m * n * k / s / 1e9:6.1f} G multiply-adds/s per thread "
                      f"({args.threads} thread{'s' if args.threads > 1 else ''})", flush=True)


if __name__ == "__main__":
    main()
