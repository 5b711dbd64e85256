"""The C++ decode stack alone, on a real batch in the middle of its generation: B prompts of
--input-len tokens through LLM.generate; at decode step --at, the captured step (the layers and
their attention, without the head and the sampler) is called --calls more times on that step's
own inputs (it rewrites the same K/V slots with the same values), each timed.

    .venv/bin/python benchmarks/bench_decode_stack.py [--model DIR] [--batch 32]

Prints the best and the median call in ms. The weights (1.2 GB for the default model in bf16)
stream from memory in every call, as in the engine; the caches' rows of the batch are read again.
For an A/B of two checkouts, run it from each in turn (PYTHONPATH=checkout), alternating.
"""
from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--at", type=int, default=40, help="the decode step whose inputs are replayed")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="LLM(kv_cache_dtype=...): auto, float32 or bfloat16")
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=max(64, args.batch), quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.llm_engine.engine_core.executor.model_runner
    captured = runner.captured_decode
    if captured is None:
        raise SystemExit(f"this model decodes without the C++ stack ({runner.decode_path})")
    steps = [0]

    class Replay:
        def __call__(self, *inputs):
            steps[0] += 1
            if steps[0] == args.at:
                times = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    captured(*inputs)
                    times.append(time.perf_counter() - t)
                times.sort()
                print(f"decode stack, {args.batch} rows at step {args.at}: best {times[0] * 1e3:.2f} ms, "
                      f"median {times[len(times) // 2] * 1e3:.2f} ms ({args.calls} calls)", flush=True)
            return captured(*inputs)

    runner.captured_decode = Replay()
    prompts = [{"prompt_token_ids": [(7 * r + 13 * i) % 30000 + 100 for i in range(args.input_len)]}
               for r in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=args.at + 8, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    if steps[0] < args.at:
        raise SystemExit(f"only {steps[0]} decode steps ran; lower --at")


if __name__ == "__main__":
    main()
