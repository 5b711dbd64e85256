"""Perplexity of a model on the shipped text, float32 against its quantized forms.

    .venv/bin/python benchmarks/bench_perplexity.py [--model NAME_OR_PATH] [--max-tokens N]
        [--quantization none gguf int8 int4]

Each form is loaded in turn. Kept blocks run through the x8 int8-activation kernels at every
batch size, so the measurement covers what decode and prefill both use.
"""
from __future__ import annotations

import argparse
import gc

from pagedllm import LLM
from pagedllm.eval.perplexity import DEFAULT_TEXT, perplexity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--quantization", nargs="+", default=["none", "gguf"])
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="LLM(kv_cache_dtype=...): auto, float32 or bfloat16")
    args = ap.parse_args()
    base = None
    for method in args.quantization:
        llm = LLM(model=args.model, dtype="float32", quantization=method, max_model_len=4096,
                  kv_cache_dtype=args.kv_cache_dtype)
        n = len(llm.get_tokenizer().encode(DEFAULT_TEXT.read_text()))
        ppl = perplexity(llm, max_tokens=args.max_tokens)
        base = ppl if base is None else base
        print(f"{method:>5}: perplexity {ppl:.3f} ({(ppl / base - 1) * 100:+.1f} % vs the first) "
              f"over {min(n, args.max_tokens or n)} tokens", flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
