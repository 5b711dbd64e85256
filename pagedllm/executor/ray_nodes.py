"""Each Ray rank's memory, read on the node it will run on before anything loads.

    driver (plan)                  node A (head)                 node B
    placement group ---------->    bundle 0                      bundle 1
    _read_node (pinned) ------>    reads its memory + cgroup
    _read_node (pinned) ------------------------------------>   reads its memory + cgroup
    plan rank 0 against A (less the driver's growth: it runs on A), rank 1 against B

A node's reading is live: what Ray's own processes there hold (raylet, GCS, dashboard, idle
workers; 442 MB on a head VM, 155 MB on a worker, issue 26) is already in its used memory, and
the reading says how much of it is Ray's. The engine process's growth is taken off the node it
runs on (memory/rank_memory.py). The executor then puts each rank on the node it was planned for.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pagedllm.memory.rank_memory import RankNodes, driver_rss, less_driver, shared_by
from pagedllm.platforms.cgroup import cgroup_paths
from pagedllm.platforms.interface import MemoryInfo, fmt_bytes

READ_TIMEOUT_S = 60.0  # a node that cannot run a small task in this long is not usable
RAY_BINARIES = ("raylet", "gcs_server")  # Ray's daemons that are not Python scripts


@dataclass(frozen=True)
class NodeMemory:
    """A Ray node's memory as a new process there reads it, and how much of the used part
    Ray's own processes hold."""

    node_id: str
    node_ip: str
    memory: MemoryInfo
    ray_bytes: int
    machine: str  # nodes with the same one share one memory (memory_identity)


def _memory_cgroup(proc_cgroup: str) -> Optional[str]:
    """The memory controller's cgroup path in a /proc/PID/cgroup text (v1, else v2)."""
    paths = cgroup_paths(proc_cgroup)
    return paths.get("memory", paths.get(""))


def memory_identity() -> str:
    """Which memory this process draws on: its machine (boot id) and the cgroup whose limit
    binds it, if any. Two Ray nodes started on one machine under one limit (or none) share
    their memory; in two cgroups of their own they do not."""
    from pagedllm.platforms.cgroup import memory_limit

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ray.util.get_node_ip_address()
    limit = memory_limit()
    return boot if limit is None else f"{boot}:{limit.path}"


def ray_process_bytes() -> int:
    """What Ray's processes that share this process's memory cgroup (the whole machine
    without one) hold: its daemons and its workers, this one included; each its PSS (shared
    library pages split among the processes mapping them), else its RSS."""
    import psutil

    own = _memory_cgroup(Path("/proc/self/cgroup").read_text())
    ray_dir = str(Path(ray.__file__).parent)
    total = 0
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if _memory_cgroup(Path(f"/proc/{proc.pid}/cgroup").read_text()) != own:
                continue
            cmd = " ".join(proc.info["cmdline"] or ())
            if proc.info["name"] in RAY_BINARIES or ray_dir in cmd or cmd.startswith("ray::"):
                total += getattr(proc.memory_full_info(), "pss", proc.memory_info().rss)
        except (OSError, psutil.Error):
            continue  # gone, or not ours to read
    return total


@ray.remote(num_cpus=0)
def _read_node() -> NodeMemory:
    """This node's memory, read as a rank's process here would read it (cgroup included)."""
    import psutil

    from pagedllm.platforms import cgroup
    from pagedllm.platforms.cpu import memory_info

    vm = psutil.virtual_memory()
    mem = memory_info(vm.available, vm.total, cgroup.memory_limit())
    ip = ray.util.get_node_ip_address()
    ray_bytes = ray_process_bytes()
    return NodeMemory(ray.get_runtime_context().get_node_id(), ip, MemoryInfo(
        mem.total_bytes, mem.available_bytes,
        f"Ray node {ip}: {mem.source}; Ray's processes there hold {fmt_bytes(ray_bytes)}, "
        "counted as used"), ray_bytes, memory_identity())


def read_nodes(node_ids: list[str]) -> dict[str, NodeMemory]:
    """Each node's memory, read there by a task pinned to it."""
    refs = [_read_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote() for node in node_ids]
    return dict(zip(node_ids, ray.get(refs, timeout=READ_TIMEOUT_S)))


def rank_nodes(world: int, bundle: dict[str, float], kind: str) -> RankNodes:
    """Where the cluster puts each of `world` ranks (a placement group like the executor's,
    removed again) and each rank's memory there: its node's, shared with the other ranks on
    that memory, less the engine process's growth where it runs too."""
    from pagedllm.executor.ray_executor import _place

    group = _place(world, bundle, kind)
    try:
        node_of = placement_group_table(group)["bundles_to_node_id"]
    finally:
        remove_placement_group(group)
    nodes = [node_of[b] for b in range(world)]
    reads = read_nodes(sorted(set(nodes)))
    ranks_on = Counter(reads[n].machine for n in nodes)
    here = memory_identity()  # the engine process's
    memories = []
    for node in nodes:
        read = reads[node]
        mem = less_driver(read.memory, driver_rss()) if read.machine == here else read.memory
        memories.append(shared_by(mem, ranks_on[read.machine]))
    return RankNodes(tuple(nodes), tuple(memories))


def ray_rank_memories(world: int, kind: str) -> Optional[RankNodes]:
    """rank_nodes for a CPU engine's `world` ranks on the cluster it joins (RAY_ADDRESS, or
    the one this process is connected to), else None: the engine's own local Ray puts every
    rank on this machine. A connection made here is closed again (the executor makes its own,
    and stops what it started)."""
    from pagedllm.executor.ray_executor import _connect

    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        return None
    joined = _connect(world)
    try:
        return rank_nodes(world, {"CPU": 1.0}, kind)
    finally:
        if joined:
            ray.shutdown()
