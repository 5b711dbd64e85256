"""The machine's cgroup v1 memory hierarchy, where the tests that make a small machine put it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
NEEDS = "needs root and a cgroup v1 memory hierarchy"


def cgroup_v1_usable() -> bool:
    """Root and cgroup v1's memory controller: what making a memory-limited cgroup takes."""
    return os.geteuid() == 0 and (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists()


def require_cgroup_v1() -> None:
    """Skip the calling test, saying why, where a memory-limited cgroup cannot be made."""
    if not cgroup_v1_usable():
        pytest.skip(NEEDS)
