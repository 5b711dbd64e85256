"""Where a batched step's time goes: ms per step by phase at several batch sizes.

    .venv/bin/python benchmarks/bench_batch_profile.py [--batches 1 16 32] [--input-len 100]
        [--output-len 128] [--model NAME]

Runs B greedy requests of --input-len prompt tokens and --output-len new tokens through
LLM.generate for each B, timing the engine's phases by wrapping them (the wrappers cost a few
microseconds a call). Decode-only steps and steps with a prompt chunk are reported apart. In a
decode-only step the C++ layer stack is split by timing its attention ops again, alone, on the
same metadata after the step (not counted in the step): what is left of the stack is the
matmuls and the small fused ops.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sample.metadata import SamplingMetadata

CLOCK = [time.perf_counter]  # --cpu-time: time.thread_time (the main thread's CPU seconds)
PHASES = ("schedule", "prepare", "layers", "attention", "head", "sampler", "update", "output")


class Timer:
    """Seconds per phase of the current step; a step's totals go to `decode` or `mixed`."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.decode: list[dict[str, float]] = []
        self.mixed: list[dict[str, float]] = []
        self.decode_step = False

    @contextmanager
    def phase(self, name: str):
        t = CLOCK[0]()
        try:
            yield
        finally:
            self.step[name] += CLOCK[0]() - t

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        setattr(obj, attr, timed)


def attention_seconds(kv_cache: torch.Tensor, meta, num_heads: int, head_dim: int,
                      scale: float) -> float:
    """The decode attention of every layer (K/V writes included) on this step's metadata."""
    dec = meta.decode
    q = torch.randn(dec.num_tokens, num_heads, head_dim)
    kv_heads = kv_cache.shape[-2]
    k = torch.randn(dec.num_tokens, kv_heads, head_dim)
    slots = meta.slot_mapping.clone()
    t = CLOCK[0]()
    for layer in kv_cache:
        torch.ops.pagedllm.write_kv_(layer, k, k, slots)
        torch.ops.pagedllm.paged_decode_attention(q, layer, dec.block_table, dec.context_lens, scale)
    return CLOCK[0]() - t


def instrument(llm: LLM, timer: Timer) -> None:
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.model_runner
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update_from_output", "update")
    timer.wrap(engine.output_processor, "process", "output")
    timer.wrap(runner, "_update_states", "prepare")
    timer.wrap(runner.attn_builder, "build", "prepare")
    timer.wrap(runner.model, "compute_logits", "head")
    timer.wrap(runner, "sampler", "sampler")
    timer.wrap(SamplingMetadata, "from_params", "sampler")
    import pagedllm.worker.model_runner as mr
    build = mr.build_step_inputs

    def timed_build(*args, **kwargs):
        with timer.phase("prepare"):
            return build(*args, **kwargs)
    mr.build_step_inputs = timed_build
    model_call, captured = runner.model.forward, runner.captured_decode
    attn = runner.model.model.layers[0].self_attn

    def layers(*args, **kwargs):
        with timer.phase("layers"):
            return model_call(*args, **kwargs)
    runner.model.forward = layers
    if captured is not None:
        class Timed:
            def __call__(self, input_ids, positions, kv_cache, meta, *rest):
                timer.decode_step = True
                with timer.phase("layers"):
                    out = captured(input_ids, positions, kv_cache, meta, *rest)
                a = attention_seconds(kv_cache, meta, attn.num_heads, attn.head_dim,
                                      attn.attn.scale)
                timer.step["attention"] += a
                timer.step["layers"] -= a
                return out
        runner.captured_decode = Timed()
    step = engine.step

    def timed_step():
        timer.step = defaultdict(float)
        timer.decode_step = False
        t = CLOCK[0]()
        out = step()
        # the replay is not part of the step; its time stands for the stack's attention
        timer.step["total"] = CLOCK[0]() - t - timer.step["attention"]
        (timer.decode if timer.decode_step else timer.mixed).append(dict(timer.step))
        return out
    engine.step = timed_step


def report(label: str, steps: list[dict[str, float]]) -> None:
    if not steps:
        return
    n = len(steps)
    mean = {k: sum(s.get(k, 0.0) for s in steps) / n * 1e3 for k in (*PHASES, "total")}
    mean["other"] = mean["total"] - sum(mean[k] for k in PHASES)
    parts = "  ".join(f"{k} {mean[k]:.2f} ({mean[k] / mean['total']:.0%})"
                      for k in (*PHASES, "other"))
    print(f"{label}: {n} steps, {mean['total']:.2f} ms/step: {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    ap.add_argument("--quantization", default=None, help="LLM(quantization=...), e.g. bf16, int8, none")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="LLM(kv_cache_dtype=...): auto, float32 or bfloat16")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the main thread's CPU seconds instead of wall time: with "
                    "--threads 1 on a shared machine, the compute without other processes' turns")
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=max(64, *args.batches), quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK[0] = time.thread_time
    timer = Timer()
    instrument(llm, timer)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1000 + i for i in range(16)]}],
                 SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    for b in args.batches:
        timer.decode, timer.mixed = [], []
        prompts = [{"prompt_token_ids": [(7 * r + 13 * i) % 30000 + 100
                                         for i in range(args.input_len)]} for r in range(b)]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        print(f"batch {b}: {wall:.2f} s, {b * args.output_len / wall:.1f} output tok/s")
        report(f"  decode-only (B={b})", timer.decode[1:])
        report(f"  with a prompt chunk (B={b})", timer.mixed)


if __name__ == "__main__":
    main()
