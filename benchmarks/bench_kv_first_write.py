"""What a KV cache page's first write costs, in a fresh process.

    .venv/bin/python benchmarks/bench_kv_first_write.py [--model DIR] [--quantization int8]

1. Arrays: writes 1 MiB into each of 48 regions (a 24-layer model's keys and values) of a fresh
   768 MiB array from np.zeros (numpy madvises it for transparent huge pages) and from
   pagedllm's KV allocation (private anonymous 4 KiB pages): ms and the huge pages resident.
2. The engine: three prompt steps of 10 x 100 random tokens (the first into a fresh cache),
   each step's seconds and its K/V writes (pagedllm::write_kv_, torch.profiler).
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.worker.kv_cache import allocate_kv_cache


def _huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def arrays() -> None:
    n = 48 * (1 << 24)  # bytes: 48 regions of 16 MiB
    for name, make in (("np.zeros", lambda: torch.from_numpy(np.zeros(n, dtype=np.uint8))),
                       ("kv cache", lambda: allocate_kv_cache(1, 1, 1, 1, n // 4, torch.float32,
                                                              torch.device("cpu")))):
        regions = make().view(torch.float32).view(48, -1)
        huge = _huge_kib()
        t = time.perf_counter()
        regions[:, :262_144] = 1.0  # 1 MiB into each
        print(f"{name}: 48 x 1 MiB first written in {(time.perf_counter() - t) * 1e3:.1f} ms, "
              f"{(_huge_kib() - huge) // 1024} MiB of huge pages")
        del regions


def engine(model: str, quantization: str) -> None:
    llm = LLM(model=model, max_num_batched_tokens=1536,
              **({} if quantization == "auto" else {"quantization": quantization}))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    for step in range(3):
        prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(100)]}
                   for _ in range(10)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
        writes = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "pagedllm::write_kv_")
        print(f"prompt step {step}: {seconds:.3f} s, K/V writes {writes / 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--quantization", default="auto")
    args = parser.parse_args()
    arrays()
    engine(args.model, args.quantization)


if __name__ == "__main__":
    main()
