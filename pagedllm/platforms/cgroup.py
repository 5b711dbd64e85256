"""What this process's cgroup allows: memory limit and usage, CPU quota (v1 and v2).

Pure readers over a filesystem root, so tests can point them at a fake tree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX * page size); anything above this is none
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit on this process's cgroup path, and what it already uses."""

    version: int
    limit_bytes: int
    usage_bytes: int  # without reclaimable page cache (clean file pages no process maps)
    path: str

    @property
    def free_bytes(self) -> int:
        """Limit minus usage, never negative."""
        return max(0, self.limit_bytes - self.usage_bytes)


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(text: Optional[str]) -> Optional[int]:
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


# memory.stat keys of the file pages the kernel reclaims before it OOM-kills (v1's hierarchical
# totals, v2's own): clean cache, active or inactive. Dirty and writeback pages must be written
# first, and mapped ones belong to a live process (reclaiming them would thrash it).
_V1_FILE_KEYS = ("total_inactive_file", "total_active_file")
_V1_PINNED_KEYS = ("total_dirty", "total_writeback", "total_mapped_file")
_V2_FILE_KEYS = ("inactive_file", "active_file")
_V2_PINNED_KEYS = ("file_dirty", "file_writeback", "file_mapped")


def reclaimable_bytes(stat: Path, file_keys: tuple[str, ...],
                      pinned_keys: tuple[str, ...]) -> int:
    """Page cache a cgroup can give back under pressure, as its memory.stat counts it."""
    cache = sum(_stat(stat, k) for k in file_keys)
    return max(0, cache - sum(_stat(stat, k) for k in pinned_keys))


def cgroup_paths(proc_self_cgroup: str) -> dict[str, str]:
    """Controller -> cgroup path from /proc/self/cgroup ('' is the v2 unified hierarchy)."""
    out: dict[str, str] = {}
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def _ancestors(base: Path, rel: str) -> list[Path]:
    """The cgroup's directory and each parent up to the hierarchy root, innermost first."""
    parts = [p for p in rel.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def memory_limit(root: Path = Path("/sys/fs/cgroup"),
                 proc_self_cgroup: Optional[str] = None) -> Optional[CgroupMemory]:
    """The tightest cgroup memory limit above this process, or None when there is none."""
    if proc_self_cgroup is None:
        proc_self_cgroup = _read(Path("/proc/self/cgroup")) or ""
    paths = cgroup_paths(proc_self_cgroup)
    best: Optional[CgroupMemory] = None
    if "memory" in paths:  # v1
        for d in _ancestors(root / "memory", paths["memory"]):
            limit = _int(_read(d / "memory.limit_in_bytes"))
            if limit is None or limit >= _NO_LIMIT:
                continue
            usage = (_int(_read(d / "memory.usage_in_bytes")) or 0) - reclaimable_bytes(
                d / "memory.stat", _V1_FILE_KEYS, _V1_PINNED_KEYS)
            if best is None or limit - usage < best.free_bytes:
                best = CgroupMemory(1, limit, max(0, usage), str(d))
    elif "" in paths:  # v2
        for d in _ancestors(root, paths[""]):
            limit = _int(_read(d / "memory.max"))
            if limit is None:
                continue
            usage = (_int(_read(d / "memory.current")) or 0) - reclaimable_bytes(
                d / "memory.stat", _V2_FILE_KEYS, _V2_PINNED_KEYS)
            if best is None or limit - usage < best.free_bytes:
                best = CgroupMemory(2, limit, max(0, usage), str(d))
    return best


def cpu_quota(root: Path = Path("/sys/fs/cgroup"),
              proc_self_cgroup: Optional[str] = None) -> Optional[int]:
    """Whole CPUs allowed by a cgroup CPU quota (rounded up), or None when unlimited."""
    if proc_self_cgroup is None:
        proc_self_cgroup = _read(Path("/proc/self/cgroup")) or ""
    paths = cgroup_paths(proc_self_cgroup)
    cpus: list[int] = []
    if "cpu" in paths:  # v1
        for d in _ancestors(root / "cpu", paths["cpu"]):
            quota, period = _int(_read(d / "cpu.cfs_quota_us")), _int(_read(d / "cpu.cfs_period_us"))
            if quota and quota > 0 and period:
                cpus.append(math.ceil(quota / period))
    elif "" in paths:  # v2: "max 100000" or "200000 100000"
        for d in _ancestors(root, paths[""]):
            fields = (_read(d / "cpu.max") or "max").split()
            quota, period = _int(fields[0]), _int(fields[1]) if len(fields) > 1 else None
            if quota and period:
                cpus.append(math.ceil(quota / period))
    return min(cpus) if cpus else None
