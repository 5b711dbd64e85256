"""Per-step cost outside the model's layers: one decode step with the model cut to one layer.

    .venv/bin/python benchmarks/bench_step_overhead.py [--model NAME] [--steps 64]

Loads the model, keeps only its first decoder layer (the output head stays), and times decode
steps of one stream: what remains is scheduling, input building, one layer, the output head,
sampling and detokenization. The full model's step time is printed beside it.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.captured_decode import CapturedDecode


def step_ms(llm: LLM, steps: int) -> float:
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1016))}
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(2000, 2016))}],
                 SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt | {"prompt_token_ids": list(range(3000, 3016))}], params, use_tqdm=False)
    return (time.perf_counter() - t - first) / (steps - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(model=args.model)
    full = step_ms(llm, args.steps)
    runner = llm.llm_engine.engine_core.executor.model_runner
    model = runner.model
    n = len(model.model.layers)
    model.model.layers = model.model.layers[:1]
    if runner.captured_decode is not None:  # the captured step holds its own list of layers
        runner.captured_decode = CapturedDecode.capture(model, True)
    one = step_ms(llm, args.steps)
    hidden = torch.randn(1, model.config.hidden_size)
    with torch.inference_mode():
        model.compute_logits(hidden)
        t = time.perf_counter()
        for _ in range(20):
            model.compute_logits(hidden)
    head = (time.perf_counter() - t) / 20 * 1e3
    print(f"decode step, {n} layers: {full:.2f} ms; cut to 1 layer: {one:.2f} ms, of which the "
          f"output head {head:.2f} ms: the rest of the step outside the layers is "
          f"{one - head:.2f} ms including one layer (C++ decode step: "
          f"{runner.captured_decode is not None})")


if __name__ == "__main__":
    main()
