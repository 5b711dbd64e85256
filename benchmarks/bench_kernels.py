"""Speed of the GGML block kernels against float32 GEMM (torch/MKL) on the default model's shapes.

    .venv/bin/python benchmarks/bench_kernels.py [--rows 1 4 16 64 512]
    .venv/bin/python benchmarks/bench_kernels.py --isa avx2 avx512vnni --rows 1 32 128
    .venv/bin/python benchmarks/bench_kernels.py --low-bit --isa avxvnni avx512vnni --threads 1


For each GGML type and shape: the x8 int8-activation kernel (what every batch size uses on
the CPU), and float32 F.linear on the already-dequantized matrix (MKL; what it would take
to beat), in ms and GFLOP/s. Single matrices stay in the cache here: for the bandwidth a whole
model sees, time a decode step (bench_step_overhead.py).

With --isa, the x8 kernel's instruction-set variants instead (kernels/csrc/ggml_x8_isa.h), timed
in turns (rounds of each variant in a row, best of the rounds, so that noise from other processes
falls on all of them alike), with each one's time against the first's.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedllm.kernels import load_kernels
from pagedllm.layers.ggml_linear import dequantize

# (type, out_features, in_features) of Qwen2.5-Coder-0.5B's Q4_K_M mix
SHAPES = [(T.Q5_0, 4864, 896), (T.Q6_K, 896, 4864), (T.Q4_K, 896, 4864), (T.Q5_0, 896, 896),
          (T.Q8_0, 128, 896), (T.Q8_0, 151936, 896)]
# --low-bit: a Qwen2-7B's Q2_K / Q3_K matrices (attention q, the MLP's gate and down), the
# 256-row part of one that stays in L2 (docs/small-machine.md)
LOW_BIT_SHAPES = [(t, n, k) for t in (T.Q2_K, T.Q3_K)
                  for n, k in ((3584, 3584), (18944, 3584), (3584, 18944), (256, 3584))]
HALF_FIELDS = {T.Q5_0: [0], T.Q8_0: [0], T.Q6_K: [208], T.Q4_K: [0, 2], T.Q2_K: [80, 82],
               T.Q3_K: [108]}


def random_blocks(qtype: T, rows: int, cols: int) -> torch.Tensor:
    rng = np.random.default_rng(0)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        half = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def timed(fn, min_time: float = 0.3) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def compare_variants(variants: list[str], rows: list[int], rounds: int, shapes=SHAPES) -> None:
    """Each variant's time per shape and row count, and its ratio to the first variant's."""
    ops = torch.ops.pagedllm
    print(f"{'type':6} {'shape':>13} {'M':>4} " + " ".join(f"{v + ' ms':>14}" for v in variants)
          + " " + " ".join(f"{v + '/' + variants[0]:>22}" for v in variants[1:]))
    for qtype, n, k in shapes:
        packed = ops.ggml_pack_x8(random_blocks(qtype, n, k), int(qtype), k)
        for m in rows:
            x = torch.randn(m, k)
            best = {v: float("inf") for v in variants}
            for _ in range(rounds):
                for v in variants:
                    ops.set_kernel_isa(v)
                    best[v] = min(best[v], timed(lambda: ops.ggml_linear_x8(x, [packed], [int(qtype)], k), 0.15))
            print(f"{qtype.name:6} {n:>6}x{k:<6} {m:>4} " + " ".join(f"{best[v] * 1e3:>14.3f}" for v in variants)
                  + " " + " ".join(f"{best[v] / best[variants[0]]:>22.3f}" for v in variants[1:]))
    ops.set_kernel_isa("auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    ap.add_argument("--isa", nargs="+", help="compare these x8 kernel variants (e.g. avx2 avx512vnni)")
    ap.add_argument("--rounds", type=int, default=5, help="turns per variant with --isa")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--low-bit", action="store_true", help="a 7B's Q2_K and Q3_K shapes instead")
    args = ap.parse_args()
    shapes = LOW_BIT_SHAPES if args.low_bit else SHAPES
    if args.threads:
        torch.set_num_threads(args.threads)
    load_kernels()
    if args.isa:
        compare_variants(args.isa, args.rows, args.rounds, shapes)
        return
    print(f"{'type':6} {'shape':>13} {'M':>4} {'kernel ms':>10} {'GF/s':>6} {'f32 ms':>8} {'GF/s':>6}")
    for qtype, n, k in shapes:
        w = random_blocks(qtype, n, k)
        wf = dequantize(w, qtype, k)
        packed = torch.ops.pagedllm.ggml_pack_x8(w, int(qtype), k)
        for m in args.rows:
            x = torch.randn(m, k)
            tq = timed(lambda: torch.ops.pagedllm.ggml_linear_x8(x, [packed], [int(qtype)], k))
            tf = timed(lambda: F.linear(x, wf))
            flop = 2 * m * n * k / 1e9
            print(f"{qtype.name:6} {n:>6}x{k:<6} {m:>4} {tq * 1e3:>10.3f} {flop / tq:>6.1f} "
                  f"{tf * 1e3:>8.3f} {flop / tf:>6.1f}")


if __name__ == "__main__":
    main()
