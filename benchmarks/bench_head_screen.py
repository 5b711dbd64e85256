"""The greedy head screen (kernels/csrc/head_screen.cpp) against the full bf16 head and argmax, on
a bf16 checkpoint's real head and real final hidden states.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_head_screen.py --model DIR

Runs the model on 32 random-token prompts of 100 tokens for 48 greedy tokens, keeping the rows
the head screen gets (the plain greedy rows: every row here), checks that the screen's tokens
are the full head's on all of them, then times one call of each at 1, 8 and 32 rows (best and
median of 15): the bf16 head + argmax, the screen, and the screen's Q8_0 matmul alone. With
--bound-stats it also models the bound in float64 (Cauchy-Schwarz on the exact error norms, as
the op bounds it, without its margins) and prints how many ids it leaves a row.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm import LLM, SamplingParams

BF16, Q8_0 = 30, 8


def _time(fn, reps: int = 15) -> tuple[float, float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[0] * 1e3, ts[len(ts) // 2] * 1e3


def _bound_stats(x: torch.Tensor, wp: torch.Tensor, wq: torch.Tensor, k: int) -> str:
    ops = torch.ops.pagedllm
    w = ops.bf16_unpack_x8(wp, k).double()  # [V, K]
    wt = ops.ggml_dequant_x8(wq, Q8_0, k).double()
    xs = x.bfloat16().double()  # x as vdpbf16ps takes it
    b = x.view(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    xt = (torch.where(d > 0, torch.round(b / d.clamp_min(1e-30)), 0.0) * d).view_as(x).double()
    exact, approx = xs @ w.T, xt @ wt.T
    bound = ((xs - xt).norm(dim=1, keepdim=True) * w.norm(dim=1)
             + xt.norm(dim=1, keepdim=True) * (w - wt).norm(dim=1))
    lo = (approx - bound).amax(dim=1, keepdim=True)
    left = ((approx + bound) >= lo).sum(dim=1).double()
    top2 = exact.topk(2, dim=1).values
    err = (approx - exact).abs()
    return (f"ids left a row: median {left.median():.0f}, mean {left.mean():.1f}, 90th "
            f"percentile {left.quantile(0.9):.0f}, most {left.max():.0f}; top-two gap median "
            f"{(top2[:, 0] - top2[:, 1]).median():.2f}; int8 error median {err.median():.3f}, "
            f"most {err.max():.3f}; bound / error at least {(bound / err.clamp_min(1e-30)).min():.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a bf16 HF checkpoint directory")
    p.add_argument("--bound-stats", action="store_true")
    args = p.parse_args()
    llm = LLM(model=args.model, max_model_len=512)
    runner = llm.llm_engine.engine_core.executor.model_runner
    screen = runner.head_screen
    if screen is None:
        raise SystemExit("this model runs without the head screen (see the start-up log)")
    rows = []
    argmax = screen.argmax
    screen.argmax = lambda x, step_rows=0: rows.append(x.clone()) or argmax(x, step_rows)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 150000) for _ in range(100)]}
               for _ in range(32)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                 use_tqdm=False)
    del screen.argmax
    x = torch.cat(rows).float()
    ops = torch.ops.pagedllm
    head, k = screen.head.weight, screen.head.in_features
    full = torch.cat([ops.argmax_rows(ops.ggml_linear_x8(x[i:i + 32], [head], [BF16], k)[0])
                      for i in range(0, len(x), 32)])
    got = torch.cat([screen.argmax(x[i:i + 32]) for i in range(0, len(x), 32)])
    print(f"{len(x)} rows: {int((got == full).sum())} the full head's token, "
          f"{int((got < 0).sum())} undecided")
    if args.bound_stats:
        print(_bound_stats(x, head, screen.wq, k))
    print("rows  bf16 head + argmax  screen  Q8_0 matmul  (ms, best / median of 15)")
    for m in (1, 8, 32):
        xm = x[:m].contiguous()
        a = _time(lambda: ops.argmax_rows(ops.ggml_linear_x8(xm, [head], [BF16], k)[0]))
        b = _time(lambda: screen.argmax(xm))
        c = _time(lambda: ops.ggml_linear_x8(xm, [screen.wq], [Q8_0], k))
        print(f"{m:4d}  {a[0]:6.2f} / {a[1]:6.2f}  {b[0]:6.2f} / {b[1]:6.2f}  "
              f"{c[0]:6.2f} / {c[1]:6.2f}")


if __name__ == "__main__":
    main()
