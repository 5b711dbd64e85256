"""A bf16 HF checkpoint two ways in one process, alternating: its matrices in bf16 on pagedllm's
kernels (dtype="auto": quantization="bf16") and upcast to float32 (dtype="float32", the path
dtype="auto" took before on a CPU without native bf16). Alternating in one process keeps a
busy machine's drift out of the ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_bf16_vs_fp32.py BF16_HF_DIR [--pairs 3]

Per pair and batch (1 and 4 streams): LLM.generate of 64 greedy tokens after a 16-token
prompt, warmed once, timed over the whole call; prints tok/s per stream.
"""
from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an HF directory whose config says torch_dtype bfloat16")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    llms = {"bf16x8": LLM(model=args.model, max_model_len=512),
            "fp32": LLM(model=args.model, dtype="float32", max_model_len=512)}
    for name, llm in llms.items():
        runner = llm.llm_engine.engine_core.executor.model_runner
        print(name, llm.llm_engine.config.quantization, runner.decode_path, flush=True)
    prompt = {"prompt_token_ids": list(range(1000, 1016))}
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for pair in range(args.pairs):
        for batch in (1, 4):
            for name, llm in llms.items():
                llm.generate([prompt] * batch, params, use_tqdm=False)  # warm
                start = time.perf_counter()
                llm.generate([prompt] * batch, params, use_tqdm=False)
                rate = 64 / (time.perf_counter() - start)
                print(f"pair {pair} {name} {batch} stream(s): {rate:.2f} tok/s per stream",
                      flush=True)


if __name__ == "__main__":
    main()
