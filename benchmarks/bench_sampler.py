"""The sampler alone: ms a step for N rows of a 152k vocabulary, PyTorch ops against pagedllm's
C++ ops (Sampler(cpu_ops=True), the CPU platform's choice: kernels/csrc/sampling.cpp).

    .venv/bin/python benchmarks/bench_sampler.py [--rows 1 16 32] [--vocab 151936] [--reps 7]

Logits: "flat" are randn x 3 (wide nuclei: the worst case for top-p), "peaked" the same with 25
ids 22 nats ahead (a chat model's shape). Each configuration is the median of --reps calls after
two untimed ones; "qwen" is Qwen2.5's generation_config (temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05) with 100 prompt and 64 output ids a row.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm.kernels import load_kernels
from pagedllm.sample import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "T 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "T 0.7, top_k 50": dict(temperature=0.7, top_k=50),
    "min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "qwen": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}


def _median_ms(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, reps: int) -> float:
    for _ in range(2):
        sampler(logits, meta)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sampler(logits, meta)
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    load_kernels()
    torch.manual_seed(0)
    rng = random.Random(0)
    v = args.vocab
    print(f"threads {torch.get_num_threads()}; vocabulary {v}; ms a step (median of {args.reps})")
    for n in args.rows:
        flat = torch.randn(n, v) * 3
        peaked = flat.clone().index_fill_(1, torch.arange(0, 25 * 37, 37), 22.0)
        prompts = [[rng.randrange(v) for _ in range(100)] for _ in range(n)]
        outputs = [[rng.randrange(v) for _ in range(64)] for _ in range(n)]
        for name in args.configs:
            params = [SamplingParams(max_tokens=8, **CONFIGS[name]) for _ in range(n)]
            meta = SamplingMetadata.from_params(params, prompts, outputs, {}, v, [v - 1])
            cells = []
            for label, logits in (("flat", flat), ("peaked", peaked)):
                torch_ms = _median_ms(Sampler(cpu_ops=False), logits, meta, args.reps)
                cpu_ms = _median_ms(Sampler(cpu_ops=True), logits, meta, args.reps)
                cells.append(f"{label}: torch {torch_ms:8.2f}  C++ {cpu_ms:6.2f}")
            print(f"N={n:3d} {name:18s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
