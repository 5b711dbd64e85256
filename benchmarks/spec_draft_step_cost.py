"""What a draft model's speculative step costs against a plain decode step, in one engine.

    python benchmarks/spec_draft_step_cost.py TARGET DRAFT [--k 4] [--tokens 64] [--prompt P]

Runs one greedy request with speculative_config {"model": DRAFT, "num_speculative_tokens": k,
"min_acceptance_rate": 0} (every step verifies k drafts, whatever is kept), then the same
request with speculation off, and times each engine step in the model runner: the target's
pass (a verify of k + 1 rows, or a plain decode row) and the draft model's proposal after it
(its catch-up pass and k - 1 decode steps). Prints one JSON object: medians in ms, the
acceptance rate, the decode tok/s of both runs, and the process's peak RSS. Run it inside a
memory cgroup to see what fits (docs/speculative_decoding.md has the 3.49 GiB figures).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Write a function that sorts a list of numbers.")
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()

    llm = LLM(model=args.target, max_model_len=args.max_model_len, max_num_seqs=4,
              speculative_config={"model": args.draft, "num_speculative_tokens": args.k,
                                  "min_acceptance_rate": 0.0})
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    steps: list[dict] = []
    execute, propose = runner.execute_model, runner._propose

    def timed_propose(lengths, out):
        t = time.perf_counter()
        propose(lengths, out)
        steps[-1]["draft_s"] = time.perf_counter() - t

    def timed_execute(sched):
        steps.append({"rows": sum(sched.num_scheduled_tokens.values()),
                      "verify": bool(sched.spec_token_ids), "draft_s": 0.0})
        t = time.perf_counter()
        out = execute(sched)
        steps[-1]["total_s"] = time.perf_counter() - t
        return out

    runner.execute_model, runner._propose = timed_execute, timed_propose
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([args.prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    steps.clear()
    stats0 = llm.llm_engine.spec_stats()
    t = time.perf_counter()
    llm.generate([args.prompt], params, use_tqdm=False)
    spec_s = time.perf_counter() - t
    spec_steps = [s for s in steps[1:]]  # after the prefill step
    got = llm.llm_engine.spec_stats().since(stats0)
    scheduler = llm.llm_engine.engine_core.scheduler
    scheduler.speculator, speculator = None, scheduler.speculator
    steps.clear()
    t = time.perf_counter()
    llm.generate([args.prompt], params, use_tqdm=False)
    plain_s = time.perf_counter() - t
    plain_steps = steps[1:]
    scheduler.speculator = speculator

    def ms(values):
        return round(1e3 * statistics.median(values), 2) if values else None

    verify = [s for s in spec_steps if s["verify"]]
    print(json.dumps({
        "k": args.k, "tokens": args.tokens,
        "plain_step_ms": ms([s["total_s"] for s in plain_steps]),
        "verify_ms": ms([s["total_s"] - s["draft_s"] for s in verify]),
        "draft_ms": ms([s["draft_s"] for s in verify]),
        "spec_step_ms": ms([s["total_s"] for s in verify]),
        "verify_steps": len(verify),
        "acceptance_rate": got.acceptance_rate,
        "mean_acceptance_length": 1 + got.num_accepted_tokens / max(1, got.num_drafts),
        "spec_tok_per_s": round(args.tokens / spec_s, 2),
        "plain_tok_per_s": round(args.tokens / plain_s, 2),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))


if __name__ == "__main__":
    main()
