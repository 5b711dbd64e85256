"""The paged attention kernel (torch.ops.pagedllm.paged_decode_attention) on the default model's
heads (14 query heads, 2 K/V heads of 64), 24 layers a step:

    .venv/bin/python benchmarks/bench_paged_attention.py decode [--len 164] [--dtype float32|bfloat16]
    .venv/bin/python benchmarks/bench_paged_attention.py prompts [--prompts 32] [--len 100]

decode: 32 sequences of --len rows in random cache blocks, one layer's cache per layer (24 caches:
read from memory, as in a step) or --hot (one cache for all 24: from the CPU's caches); the best
and median of 8 steps in ms. prompts: --prompts fresh prompts of --len tokens, their attention as
the CPU backend ran it before (SDPA, one call per prompt and layer) and as it runs it now (every
row a decode row of one paged call, attention/backends/cpu.py); ms for 24 layers, twice each in
turns, and the largest difference between the two.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from pagedllm.kernels import load_kernels

HQ, HK, D, BS, LAYERS = 14, 2, 64, 16, 24


def decode(args: argparse.Namespace) -> None:
    b, length = 32, args.len
    per = -(-length // BS)
    dtype = getattr(torch, args.dtype)
    caches = [torch.randn(2, b * per, BS, HK, D).to(dtype) for _ in range(1 if args.hot else LAYERS)]
    table = torch.randperm(b * per).view(b, per).contiguous()
    lens = torch.full((b,), length, dtype=torch.long)
    q = torch.randn(b, HQ, D)
    times = []
    for _ in range(8):
        t = time.perf_counter()
        for layer in range(LAYERS):
            torch.ops.pagedllm.paged_decode_attention(q, caches[layer % len(caches)], table, lens,
                                                      D ** -0.5, 0, 0.0)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"decode, 32 x {length} rows, {args.dtype} cache{' (hot)' if args.hot else ''}: "
          f"best {times[0] * 1e3:.2f} ms, median {times[4] * 1e3:.2f} ms for {LAYERS} layers")


def prompts(args: argparse.Namespace) -> None:
    n, s = args.prompts, args.len
    q, k, v = torch.randn(n * s, HQ, D), torch.randn(n * s, HK, D), torch.randn(n * s, HK, D)
    per = -(-s // BS)
    cache = torch.zeros(2, n * per, BS, HK, D)
    table = torch.arange(n * per).view(n, per)
    slots = torch.cat([table[i].repeat_interleave(BS)[:s] * BS + torch.arange(s) % BS for i in range(n)])
    torch.ops.pagedllm.write_kv_(cache, k, v, slots)

    def sdpa() -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(n):
            rows = slice(i * s, (i + 1) * s)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                                               v[rows].transpose(0, 1)[None], is_causal=True,
                                               scale=D ** -0.5, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out

    rows_table = table.repeat_interleave(s, 0).contiguous()
    rows_lens = (torch.arange(s) + 1).repeat(n).contiguous()

    def paged() -> torch.Tensor:
        return torch.ops.pagedllm.paged_decode_attention(q, cache, rows_table, rows_lens, D ** -0.5, 0, 0.0)

    print(f"largest difference {(sdpa() - paged()).abs().max().item():.2e}")
    for name, fn in (("sdpa", sdpa), ("paged", paged)) * 2:
        t = time.perf_counter()
        for _ in range(LAYERS):
            fn()
        print(f"{name}: {n} prompts of {s} tokens, {(time.perf_counter() - t) * 1e3:.1f} ms for {LAYERS} layers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["decode", "prompts"])
    ap.add_argument("--len", type=int, default=None, help="rows a sequence reads (decode: 164) or prompt tokens (100)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--hot", action="store_true", help="decode: one cache for every layer")
    args = ap.parse_args()
    if args.len is None:
        args.len = 164 if args.mode == "decode" else 100
    load_kernels()
    (decode if args.mode == "decode" else prompts)(args)


if __name__ == "__main__":
    main()
