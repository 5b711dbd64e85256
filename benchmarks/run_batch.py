"""A plain batched run to profile from outside (perf, py-spy): B greedy requests of
--input-len token-id prompts and --output-len new tokens through LLM.generate, after a short
warm-up on the same prompts.

    perf record -F 999 -g -o perf.data .venv/bin/python benchmarks/run_batch.py
    perf report -i perf.data --no-children --sort dso,symbol -g none
"""
from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=max(64, args.batch))
    prompts = [{"prompt_token_ids": [(7 * r + 13 * i) % 30000 + 100 for i in range(args.input_len)]}
               for r in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    print(f"{args.batch} x ({args.input_len} + {args.output_len}): {wall:.2f} s, "
          f"{args.batch * args.output_len / wall:.1f} output tok/s")


if __name__ == "__main__":
    main()
