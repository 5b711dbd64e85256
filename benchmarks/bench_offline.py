"""Offline speed of pagedllm: load time, one-stream prefill/decode, batched output throughput, peak RSS.

    .venv/bin/python benchmarks/bench_offline.py [--model NAME_OR_PATH] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import resource
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=16)
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    vocab = llm.get_tokenizer().vocab_size

    def prompt(i: int, n: int) -> dict:
        return {"prompt_token_ids": [(1000 + 37 * i + 13 * j) % vocab for j in range(n)]}

    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate([prompt(99, 8)], SamplingParams(max_tokens=2, **greedy), use_tqdm=False)  # warm-up

    t = time.perf_counter()
    llm.generate([prompt(0, 512)], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill = 512 / (time.perf_counter() - t)

    t = time.perf_counter()
    llm.generate([prompt(1, args.input_len)], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt(2, args.input_len)], SamplingParams(max_tokens=args.output_len, **greedy),
                 use_tqdm=False)
    decode = (args.output_len - 1) / (time.perf_counter() - t - ttft)

    prompts = [prompt(10 + i, args.input_len) for i in range(args.num_prompts)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, **greedy), use_tqdm=False)
    batch = args.num_prompts * args.output_len / (time.perf_counter() - t)

    result = {
        "model": args.model, "dtype": str(llm.llm_engine.config.dtype),
        "load_s": round(load_s, 2), "prefill_tok_per_s": round(prefill, 1),
        "ttft_s": round(ttft, 3), "decode_tok_per_s": round(decode, 2),
        f"batch{args.num_prompts}_output_tok_per_s": round(batch, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
