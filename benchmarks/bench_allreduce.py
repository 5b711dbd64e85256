"""What one gloo all-reduce of a decode step's hidden state costs between two local processes:
the floor under tensor parallelism's 2 all-reduces a layer on this machine.

    .venv/bin/python benchmarks/bench_allreduce.py [--hidden 896] [--iters 1000]

Two processes (torch.multiprocessing, one torch thread each) join a gloo group through a file
store and all-reduce a float32 [hidden] tensor in a tight loop, then after 0.5 ms of busy work
each time (as between two layers). Prints microseconds per all-reduce."""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, init: str, hidden: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = torch.randn(hidden)
    for _ in range(50):
        dist.all_reduce(x)
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    tight = (time.perf_counter() - started) / iters
    busy_s, n = 0.0005, max(1, iters // 5)
    started = time.perf_counter()
    for _ in range(n):
        spin = time.perf_counter()
        while time.perf_counter() - spin < busy_s:
            pass
        dist.all_reduce(x)
    after_work = (time.perf_counter() - started) / n - busy_s
    if rank == 0:
        print(f"gloo all_reduce of {hidden * 4} bytes, 2 processes: {tight * 1e6:.0f} us in a "
              f"tight loop, {after_work * 1e6:.0f} us after 0.5 ms of work")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--iters", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        mp.spawn(_rank, args=(init, args.hidden, args.iters), nprocs=2)


if __name__ == "__main__":
    main()
