"""README's "what runs where" table, from the planner: Qwen2.5 0.5B/1.5B/3B and Qwen2-7B shapes
(tests/data/*-shapes) on machines of 3.49 GiB, 8 GiB and 32 GiB, each way's expected one-stream
decode from the planner's bandwidth model (pagedllm/memory/decode_speed.py). Estimates, not
measurements. Run from the repository root:

    PYTHONPATH=$PWD python scripts/what_runs_where.py

A cell names the tested format (a Q4_K_M GGUF), the fastest when it is another, and bf16, each
with its expected tok/s: on one machine ("mapped": its GGUF blocks mapped from a file), else
"-pp N" over N such machines.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.memory.advice import FormatWays, Way, all_format_ways
from pagedllm.memory.advice_text import rate
from pagedllm.memory.plan import PlanLimits
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import GiB, MemoryInfo

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
MODELS = (("Qwen2.5-0.5B", "qwen2.5-0.5b-instruct-shapes"),
          ("Qwen2.5-1.5B", "qwen2.5-1.5b-instruct-shapes"),
          ("Qwen2.5-3B", "qwen2.5-3b-instruct-shapes"), ("Qwen2-7B", "qwen2-7b-instruct-shapes"))
# what the machine's cgroup limit leaves free to a fresh process: the seed VM's 3.49 GiB
# cgroup showed 3.33 GiB free to doctor (docs/memory.md), ~160 MiB in use already
MACHINES = (("2 vCPU, 3.49 GiB", 3.49), ("8 GiB", 8.0), ("32 GiB", 32.0))
IN_USE = 160 * 1024 ** 2
# the engine's defaults (EngineArgs, the CPU's token budget), a 2048-token sequence as the
# planner's shortest default, the runtime it plans a process
SIZES = dict(block_size=16, max_model_len=2048, max_num_seqs=64, overhead_bytes=384 * 1024 ** 2)


def way_text(name: str, way: Optional[Way]) -> str:
    """'Q4_K_M ~75', 'Q4_K_M mapped ~12', 'Q4_K_M -pp 2 ~5.0' (tok/s), 'bf16: no split fits'."""
    if way is None:
        return f"{name}: no split fits"
    where = (" mapped" if way.mapped else "") if way.machines == 1 else (
        f" -tp {way.tensor_parallel_size}" if way.tensor_parallel_size > 1
        else f" -pp {way.pipeline_parallel_size}")
    return f"{name}{where} {rate(way.tok_per_s).removesuffix(' tok/s')}"


def cell(ways: list[FormatWays]) -> str:
    """The tested format (Q4_K_M) and bf16, each on one machine, else on the fewest pipeline
    ranks (the even split), one a machine; between them the fastest format when it is
    another, in its fastest way (one machine, pipeline or tensor parallel ranks)."""
    by = {w.fmt.name: w for w in ways}
    fastest = max((w for w in ways if w.best), key=lambda w: w.best.tok_per_s)
    names = ["Q4_K_M"] + ([fastest.fmt.name] if fastest.fmt.name not in ("Q4_K_M", "bf16")
                          else []) + ["bf16"]
    return "; ".join(way_text(n, by[n].best if n == fastest.fmt.name else by[n].one or by[n].pp)
                     for n in names)


def table() -> list[list[str]]:
    """Rows: model, then one cell per machine."""
    rows = []
    for label, name in MODELS:
        ckpt = resolve_checkpoint(DATA / name)
        n, source = checkpoint_num_params(ckpt)
        row = [f"{label} ({n / 1e9:.2f} B)"]
        for _, gib in MACHINES:
            total = int(gib * GiB)
            mem = MemoryInfo(total, total - IN_USE, f"{gib} GiB")
            limits = PlanLimits(**SIZES, max_num_batched_tokens=CpuPlatform()
                                .default_max_num_batched_tokens(ckpt.arch.intermediate_size, False))
            row.append(cell(all_format_ways(ckpt.arch, n, source, mem, limits)))
        rows.append(row)
    return rows


def markdown(rows: list[list[str]]) -> str:
    """The table in README's form."""
    head = ["model"] + [m for m, _ in MACHINES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    print(markdown(table()))
