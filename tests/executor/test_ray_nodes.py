"""Each Ray rank's memory read on its node: on a local two-node cluster (ray.cluster_utils,
both nodes on this machine and in one cgroup) the reading finds both nodes drawing on one
memory, so each rank gets half of it, less the engine process's growth; Ray's own processes
are counted. The executor puts each rank in a bundle on the node it was planned on."""
from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from pagedllm.executor.ray_executor import rank_bundles
from pagedllm.executor.ray_nodes import memory_identity, rank_nodes, read_nodes
from pagedllm.memory.rank_memory import RankNodes
from pagedllm.platforms.interface import MemoryInfo

NODE = dict(num_cpus=1, object_store_memory=100 * 2**20)


def test_rank_bundles_follow_the_planned_nodes():
    node_of = {0: "b", 1: "a"}
    assert rank_bundles(node_of, ("a", "b"), 2) == [1, 0]
    assert rank_bundles(node_of, (), 2) == [0, 1]  # not planned per node: in order
    # two ranks planned on one node, which the group holds twice
    assert rank_bundles({0: "a", 1: "b", 2: "a"}, ("a", "a", "b"), 3) == [0, 2, 1]


def test_a_rank_whose_node_is_gone_takes_the_bundle_left(caplog):
    assert rank_bundles({0: "c", 1: "a"}, ("a", "b"), 2) == [1, 0]
    assert "rank 1 was planned on Ray node b" in caplog.text


def test_the_rank_that_needs_most_gets_the_most_memory():
    """The head node (Ray's GCS, the engine process) has less room than a worker node: the
    last stage, which also holds the head, goes to the worker."""
    head, worker = MemoryInfo(4, 2, "head"), MemoryInfo(4, 3, "worker")
    planned = RankNodes(("h", "w"), (head, worker))
    assert planned.fit([1, 2]) == RankNodes(("h", "w"), (head, worker))
    assert planned.fit([2, 1]) == RankNodes(("w", "h"), (worker, head))
    assert planned.fit([1, 1]) == RankNodes(("w", "h"), (worker, head))  # ties: rank order


@pytest.fixture(scope="module")
def two_nodes():
    """Two one-CPU Ray nodes on this machine, joined; stopped after the module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        cluster = Cluster(initialize_head=True,
                          head_node_args=dict(NODE, include_dashboard=False))
        try:
            cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_each_node_is_read_where_it_runs(two_nodes):
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    reads = read_nodes(nodes)
    assert [reads[n].node_id for n in nodes] == nodes  # each read ran on its own node
    for read in reads.values():
        assert read.ray_bytes > 50 * 2**20, read  # raylet and the worker that read, at least
        assert read.memory.source.startswith(f"Ray node {read.node_ip}: ")
        assert "Ray's processes there hold" in read.memory.source
        assert read.machine == memory_identity()  # this machine, this cgroup


def test_ranks_on_nodes_that_share_one_memory_each_plan_with_a_part(two_nodes):
    planned = rank_nodes(2, {"CPU": 1.0}, "pipeline parallel")
    assert len(set(planned.node_ids)) == 2, "STRICT_SPREAD: one rank on each node"
    assert ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    for mem in planned.memories:
        assert "shared by 2 ranks, 1/2 each" in mem.source, mem.source
        assert "the engine process runs here too" in mem.source, mem.source
        assert mem.available_bytes < mem.total_bytes // 2
