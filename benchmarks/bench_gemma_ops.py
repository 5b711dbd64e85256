"""Two ops of Gemma 3 270M's decode step, timed as one op call each from Python (best of 7
rounds of 3,000 calls, after 200 warm-up calls):

    PYTHONPATH=. .venv/bin/python benchmarks/bench_gemma_ops.py

- gelu_tanh_mul on one 2,048-wide row (Gemma 3 270M's FFN);
- paged_decode_attention of one sequence with 4 query heads on one K/V head, head_dim 256, 150
  keys (one stream; its query heads split over two threads).

Run it from the checkout to time (PYTHONPATH=.): a script's own directory, not the working
directory, heads sys.path, so without it another checkout's package may be the one imported.
"""
from __future__ import annotations

import time

import torch

import pagedllm
from pagedllm.kernels import load_kernels


def best_us(f, reps: int = 3000) -> float:
    for _ in range(200):
        f()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def main() -> None:
    load_kernels()
    ops = torch.ops.pagedllm
    print(f"package: {pagedllm.__file__}, threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    gate, up = torch.randn(1, 2048) * 3, torch.randn(1, 2048)
    print(f"gelu_tanh_mul [1, 2048]: {best_us(lambda: ops.gelu_tanh_mul(gate, up)):.1f} us")
    d, hq, hk, bs, n = 256, 4, 1, 16, 150
    kv = torch.randn(2, 64, bs, hk, d)
    table, q, lens = torch.arange(10).view(1, 10), torch.randn(1, hq, d), torch.tensor([n])
    us = best_us(lambda: ops.paged_decode_attention(q, kv, table, lens, d ** -0.5))
    print(f"paged_decode_attention, 4 query heads on 1 K/V head, d 256, {n} keys: {us:.1f} us")


if __name__ == "__main__":
    main()
