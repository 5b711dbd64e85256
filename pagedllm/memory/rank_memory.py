"""A rank's memory as it will be when the engine runs: shared with the ranks on its machine,
and less what the engine process (the driver) will still take where it shares that memory.

    VM A (3.49 GiB)                          VM B (3.49 GiB)
    engine process: tokenizer, scheduler,    rank 1 (layers 14-27, head)
      API server (~0.5 GB, counted here)
    rank 0 (layers 0-13, embedding)

What the engine process already holds is in what a read of the memory finds used; what it
will hold once it serves is not, so the rank beside it plans without that. Each rank's own
cgroup (PAGEDLLM_RANK_CGROUP) is read here before its process exists; RankNodes holds where Ray
ranks will run and the memory each has there (executor/ray_nodes.py reads it on the nodes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pagedllm.platforms.cgroup import cgroup_paths
from pagedllm.platforms.interface import MemoryInfo, fmt_bytes

# The engine process serving: torch, the tokenizer, the scheduler and the API server with its
# streams. `pagedllm serve` on the Qwen2-7B-shaped GGUF with -pp 2 held 0.5 GB (issue 26); the
# plan counts it where it runs, less what the process holds when the plan is made.
DRIVER_RUNTIME_BYTES = 640 * 2**20


def driver_rss() -> int:
    """What the engine process holds now."""
    import psutil

    return psutil.Process().memory_info().rss


def less_driver(mem: MemoryInfo, rss: int, runtime: int = DRIVER_RUNTIME_BYTES) -> MemoryInfo:
    """`mem` read where the engine process runs too (its `rss` already counted as used there):
    less what it will still take to serve."""
    growth = max(0, runtime - rss)
    return MemoryInfo(mem.total_bytes, max(0, mem.available_bytes - growth),
                      f"{mem.source}; the engine process runs here too: it holds "
                      f"{fmt_bytes(rss)} and ~{fmt_bytes(growth)} more to serve")


def shared_by(mem: MemoryInfo, ranks: int) -> MemoryInfo:
    """One rank's part of a machine's memory that `ranks` ranks share (an equal part each)."""
    if ranks == 1:
        return mem
    return MemoryInfo(mem.total_bytes, mem.available_bytes // ranks,
                      f"{mem.source}; shared by {ranks} ranks, 1/{ranks} each")


def own_memory_cgroup(root: Path = Path("/sys/fs/cgroup"),
                      proc_self_cgroup: Optional[str] = None) -> Optional[Path]:
    """The memory cgroup directory this process is in (v1, else v2), or None."""
    if proc_self_cgroup is None:
        try:
            proc_self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    paths = cgroup_paths(proc_self_cgroup)
    if "memory" in paths:
        return (root / "memory" / paths["memory"].lstrip("/")).resolve()
    if "" in paths:
        return (root / paths[""].lstrip("/")).resolve()
    return None


def holds_driver(rank_dir: str, driver_dir: Optional[Path]) -> bool:
    """Whether a rank's cgroup `rank_dir` holds the engine process (it, or a cgroup inside it)."""
    if driver_dir is None:
        return False
    rank = Path(rank_dir).resolve()
    return driver_dir == rank or rank in driver_dir.parents


RANK_CGROUP_ENV = "PAGEDLLM_RANK_CGROUP"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def rank_cgroup(rank: int) -> Optional[str]:
    """The cgroup directory rank `rank` joins (PAGEDLLM_RANK_CGROUP), or None."""
    template = os.environ.get(RANK_CGROUP_ENV)
    if not template:
        return None
    if "{rank}" not in template:
        raise ValueError(f"{RANK_CGROUP_ENV}={template!r} must hold a {{rank}} placeholder: "
                         "each rank needs a cgroup of its own")
    return template.replace("{rank}", str(rank))


def cgroup_memory(directory: str) -> MemoryInfo:
    """What a process in the cgroup `directory` may use (v1 under /sys/fs/cgroup/memory, else
    v2), read from here before the process exists, as the process itself would read it."""
    import psutil

    from pagedllm.platforms.cgroup import memory_limit
    from pagedllm.platforms.cpu import memory_info

    path = Path(directory).resolve()
    v1 = CGROUP_ROOT / "memory"
    try:
        line = (f"1:memory:/{path.relative_to(v1)}" if path.is_relative_to(v1)
                else f"0::/{path.relative_to(CGROUP_ROOT)}")
    except ValueError:
        raise ValueError(f"{RANK_CGROUP_ENV}: {directory} is not a cgroup directory under "
                         f"{CGROUP_ROOT}") from None
    if not (path / "cgroup.procs").exists():
        raise ValueError(f"{RANK_CGROUP_ENV}: {directory} is not a cgroup (no cgroup.procs); "
                         "make it first (mkdir, then write its memory limit)")
    vm = psutil.virtual_memory()
    info = memory_info(vm.available, vm.total, memory_limit(CGROUP_ROOT, line))
    return MemoryInfo(info.total_bytes, info.available_bytes, f"{directory}: {info.source}")


def own_memory(mem: MemoryInfo) -> MemoryInfo:
    """What a rank may use, read in its own process: what is free plus what the process
    already holds (Python, torch), which the plan counts as its runtime."""
    import psutil

    rss = psutil.Process().memory_info().rss
    return MemoryInfo(mem.total_bytes, min(mem.total_bytes, mem.available_bytes + rss),
                      f"{mem.source}; this rank already holds {rss / 2**20:.0f} MiB of its "
                      "runtime")


def rank_memories(world_size: int) -> Optional[list[MemoryInfo]]:
    """Each rank's memory when each runs in its own cgroup (PAGEDLLM_RANK_CGROUP), else None:
    the ranks share this machine's memory. The rank whose cgroup holds the engine process
    plans without what that process will still take to serve."""
    dirs = [rank_cgroup(r) for r in range(world_size)]
    if dirs[0] is None:
        return None
    driver = own_memory_cgroup(CGROUP_ROOT)  # the engine process is counted where it runs
    return [less_driver(cgroup_memory(d), driver_rss()) if holds_driver(d, driver)
            else cgroup_memory(d) for d in dirs]


@dataclass(frozen=True)
class RankNodes:
    """The node each rank was planned on, and the memory each rank plans with (global rank
    order)."""

    node_ids: tuple[str, ...]
    memories: tuple[MemoryInfo, ...]

    def fit(self, needs: Sequence[int]) -> "RankNodes":
        """The same bundles with the rank that needs most on the most memory, and so on down
        (a head node, with Ray's GCS and the engine process, has the least); needs: each
        rank's bytes, in rank order."""
        by_room = sorted(range(len(self.memories)),
                         key=lambda b: -self.memories[b].available_bytes)
        by_need = sorted(range(len(needs)), key=lambda r: -needs[r])
        slot = dict(zip(by_need, by_room))  # rank -> bundle
        return RankNodes(tuple(self.node_ids[slot[r]] for r in range(len(needs))),
                         tuple(self.memories[slot[r]] for r in range(len(needs))))
