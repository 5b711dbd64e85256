"""The seed user's two VMs, each a 3.49 GiB cgroup v1 on this machine: a Ray head node in one,
a worker node in the other, `pagedllm serve` of a Qwen2-7B-shaped Q4_K GGUF (4.4 GB, random)
with -pp 2 on Ray in the first. Each stage is planned against its own node's memory (Ray's
processes and, on the head, the engine process counted), both serve a request, neither cgroup
is OOM-killed. ~4 minutes here (1 to write the GGUF, 1.5 to load: each stage writes its
regrouped blocks once); root and cgroup v1 only, like test_small_machine.py."""
from __future__ import annotations

import re

import pytest

from cgroup_v1 import NEEDS, cgroup_v1_usable
from two_ray_vms import SEED_VM_LIMIT, serve_on_two_vms

# the GGUF is the session's qwen7b_q4_k (tests/conftest.py), written once for this file and
# test_small_machine.py; without root and cgroup v1 it is not written at all
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cgroup_v1_usable(), reason=NEEDS)]


def test_qwen7b_q4_k_pp2_serves_on_two_ray_nodes_in_3_49_gib_each(qwen7b_q4_k, tmp_path):
    result = serve_on_two_vms(qwen7b_q4_k, tmp_path)
    log = result["log"]
    assert result["reply"]["usage"]["completion_tokens"] == 8, result["reply"]
    # one stage's actor in each VM
    assert result["actors"] == {"head": ["ray::RankActor"], "worker": ["ray::RankActor"]}
    assert all("oom_kill 0" in oom for oom in result["oom"].values()), result["oom"]
    assert all(0 < peak <= SEED_VM_LIMIT for peak in result["peak"].values())
    # the driver planned each stage against the node it runs on, not both against its own
    plans = [line for line in log.splitlines() if "(RankActor" not in line
             and ("memory plan (pipeline rank" in line)]
    assert len(plans) == 2, log[-4000:]
    assert "ranks on this machine, sharing its memory" not in log
    for line in plans:
        assert "(Ray node " in line and "cgroup v1 limit 3.49 GiB" in line, line
        assert "Ray's processes there hold" in line, line
    # the stage on the head node shares its VM with serve, and its actor runs there
    on_head = [line for line in plans if "the engine process runs here too" in line]
    assert len(on_head) == 1, plans
    rank = re.search(r"pipeline rank (\d) of 2", on_head[0]).group(1)
    pid = re.search(rf"rank {rank} \(pid (\d+) on node", log).group(1)
    assert int(pid) in result["pids"]["head"], (pid, result["pids"])
    print(f"\nPP=2 on two Ray nodes, 3.49 GiB each: healthy after {result['ready_s']:.0f} s, "
          f"8 tokens in {result['request_s']:.1f} s; peak head "
          f"{result['peak']['head'] / 2**30:.2f} GiB, worker "
          f"{result['peak']['worker'] / 2**30:.2f} GiB; Ray alone "
          f"{result['ray_only_bytes']['head'] / 2**20:.0f} / "
          f"{result['ray_only_bytes']['worker'] / 2**20:.0f} MiB; serve RSS "
          f"{result['server_rss'] / 2**20:.0f} MiB\n" + "\n".join(plans))
