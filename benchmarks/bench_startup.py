"""Process start to first token, with a warm file cache: the phases of a fresh interpreter.

    .venv/bin/python benchmarks/bench_startup.py [--model NAME]

Run it as a new process each time (start-up is what it measures); the clock starts before
`import torch`. Prints the import of torch, of transformers, of pagedllm, `LLM(...)`, the first
token, and the total.
"""
import time

t0 = time.perf_counter()
import argparse  # noqa: E402

import torch  # noqa: E402,F401

t1 = time.perf_counter()
import transformers  # noqa: E402,F401

t2 = time.perf_counter()
from pagedllm import LLM, SamplingParams  # noqa: E402

t3 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    t4 = time.perf_counter()
    llm = LLM(model=args.model)
    t5 = time.perf_counter()
    llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False)
    t6 = time.perf_counter()
    print(f"import torch {t1 - t0:.2f} s, transformers {t2 - t1:.2f} s, pagedllm {t3 - t2:.2f} s; "
          f"LLM() {t5 - t4:.2f} s; first token {t6 - t5:.2f} s; start to first token "
          f"{t6 - t0:.2f} s")


if __name__ == "__main__":
    main()
