"""A rank's memory as it will be when the engine runs: shared with the ranks on its machine,
and less what the engine process (the driver) will still take where it shares that memory.

    VM A (3.49 GiB)                          VM B (3.49 GiB)
    engine process: tokenizer, scheduler,    rank 1 (layers 14-27, head)
      API server (~0.5 GB, counted here)
    rank 0 (layers 0-13, embedding)

What the engine process already holds is in what a read of the memory finds used; what it
will hold once it serves is not, so the rank beside it plans without that.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

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
