"""One batch of fresh random prompts a round through LLM.generate: the figure to profile a phase by.

    .venv/bin/python benchmarks/bench_batch_rounds.py [--quantization Q] [--num-prompts 32]
        [--input-len 100] [--output-len 1] [--rounds 3] [--warmup 4] [--model DIR]

Each round draws new prompt ids (random.seed(0) once, so a run repeats its prompts and no round
hits the prefix cache of an earlier one) and prints the round's seconds and tok/s: prompt tok/s
with --output-len 1 (prefill), output tok/s otherwise. Run under `perf record -F 999 -g` and
compare a kernel's samples against an unchanged one's, when the machine's speed moves too much
for wall-clock A/B runs (docs/performance.md, "The AMX matmuls streaming their weights"):
    prefill: --input-len 100 --output-len 1 --rounds 3 --warmup 4
    decode:  --input-len 16 --output-len 256 --rounds 2 --warmup 0
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4, help="prompts of a first draw run once before the rounds")
    args = ap.parse_args()
    llm = LLM(model=args.model, quantization=args.quantization)
    random.seed(0)

    def fresh() -> list[dict]:
        return [{"prompt_token_ids": [random.randint(100, 20000) for _ in range(args.input_len)]}
                for _ in range(args.num_prompts)]

    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    if args.warmup:
        llm.generate(fresh()[:args.warmup], sp, use_tqdm=False)
    for _ in range(args.rounds):
        prompts = fresh()
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        if args.output_len == 1:
            n = args.num_prompts * args.input_len
            print(f"prefill {n} tokens: {dt:.2f} s, {n / dt:.0f} tok/s", flush=True)
        else:
            n = args.num_prompts * args.output_len
            print(f"decode {args.num_prompts}x{args.output_len}: {dt:.2f} s, {n / dt:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
