"""A rank's memory as it will be when the engine serves: the engine process's growth taken off
the memory it shares with a rank (an mp rank's cgroup, a Ray node), and a machine's memory
shared among the ranks on it. The cgroup test runs a real engine-side process inside a real
cgroup v1 beside a second one (root and cgroup v1 only)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import pagedllm
from pagedllm.memory.rank_memory import (DRIVER_RUNTIME_BYTES, holds_driver, less_driver,
                                           own_memory_cgroup, shared_by)
from pagedllm.platforms.interface import MemoryInfo

from cgroup_v1 import CGROUP_V1_MEMORY, require_cgroup_v1

GiB = 2**30
MiB = 2**20


def test_less_driver_takes_off_what_the_engine_process_will_still_take():
    mem = MemoryInfo(4 * GiB, 3 * GiB, "cgroup v1 limit 4.00 GiB")
    out = less_driver(mem, rss=200 * MiB, runtime=640 * MiB)
    assert out.available_bytes == 3 * GiB - 440 * MiB and out.total_bytes == 4 * GiB
    assert "the engine process runs here too: it holds 200 MiB and ~440 MiB more" in out.source
    # a process already past its runtime takes nothing more
    assert less_driver(mem, rss=900 * MiB, runtime=640 * MiB).available_bytes == 3 * GiB
    # never below nothing
    assert less_driver(MemoryInfo(GiB, 100 * MiB, "x"), 0).available_bytes == 0


def test_shared_by_gives_each_rank_an_equal_part():
    mem = MemoryInfo(8 * GiB, 6 * GiB, "system")
    assert shared_by(mem, 1) is mem
    two = shared_by(mem, 2)
    assert two.available_bytes == 3 * GiB and two.source == "system; shared by 2 ranks, 1/2 each"


def test_own_memory_cgroup_reads_v1_then_v2(tmp_path):
    v1 = "12:memory:/vm0\n11:cpu:/\n"
    assert own_memory_cgroup(tmp_path, v1) == (tmp_path / "memory" / "vm0").resolve()
    assert own_memory_cgroup(tmp_path, "0::/vm1\n") == (tmp_path / "vm1").resolve()
    assert own_memory_cgroup(tmp_path, "") is None


def test_holds_driver_for_its_own_cgroup_or_one_above_it(tmp_path):
    rank = tmp_path / "vm0"
    assert holds_driver(str(rank), rank.resolve())
    assert holds_driver(str(rank), (rank / "engine").resolve())
    assert not holds_driver(str(tmp_path / "vm1"), rank.resolve())
    assert not holds_driver(str(rank), None)


RANK_MEMORIES_JOB = """
import json
from pagedllm.memory.rank_memory import rank_memories
print(json.dumps([[m.available_bytes, m.source] for m in rank_memories(2)]))
"""


def test_mp_rank_in_the_engine_process_cgroup_plans_without_its_runtime(tmp_path):
    """The engine process in rank 0's cgroup (VM A), rank 1's cgroup empty (VM B): rank 0
    plans with the engine process's runtime taken off, rank 1 with its whole cgroup."""
    require_cgroup_v1()
    tag = uuid.uuid4().hex[:8]
    cgs = [CGROUP_V1_MEMORY / f"pagedllm-rankmem-{tag}-{r}" for r in range(2)]
    for cg in cgs:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(3 * GiB))
    try:
        # only the name's last "-0": the random tag may start with 0 ("...-0a1b...-0")
        env = dict(os.environ, PAGEDLLM_RANK_CGROUP=str(cgs[0])[:-len("-0")] + "-{rank}",
                   PYTHONPATH=str(Path(pagedllm.__file__).parents[1]))  # this checkout's
        script = tmp_path / "job.py"
        script.write_text(RANK_MEMORIES_JOB)
        proc = subprocess.run(["sh", "-c", f'echo $$ > {cgs[0]}/cgroup.procs && exec '
                               f'"{sys.executable}" "{script}"'], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        for cg in cgs:
            cg.rmdir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    (free0, source0), (free1, source1) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "the engine process runs here too" in source0, source0
    assert "engine process" not in source1, source1
    # rank 0's cgroup holds the engine process (counted as used) and its growth to come: its
    # whole runtime, less the part of its RSS (shared libraries) whose pages were already
    # charged to another cgroup when it mapped them (~80 MiB here)
    assert DRIVER_RUNTIME_BYTES - 192 * MiB < free1 - free0 <= DRIVER_RUNTIME_BYTES + 64 * MiB, \
        (free1 - free0) / MiB
