"""Executors: how the engine core reaches its workers (one in this process, one local process
per pipeline rank, or one Ray actor per rank on a Ray cluster), behind one interface."""
from __future__ import annotations

from typing import Optional

from pagedllm.config import ParallelConfig
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.memory.rank_memory import RankNodes


def executor_class(parallel: ParallelConfig) -> type[Executor]:
    """The executor for a parallel config's backend: "uni" in-process, "mp" one process per
    rank, "ray" one Ray actor per rank (Ray, an optional extra, imported only then)."""
    if parallel.backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    return UniProcExecutor if parallel.backend == "uni" else MultiprocExecutor


def read_rank_nodes(parallel: ParallelConfig) -> Optional[RankNodes]:
    """Where each rank of a Ray engine will run and the memory it has there, read on its node
    before anything loads (executor/ray_nodes.py), else None: the local backends' ranks, and
    those of a Ray the engine starts itself, run on this machine, whose memory the planner
    reads."""
    if parallel.backend != "ray":
        return None
    from pagedllm.executor.ray_nodes import ray_rank_memories

    kind = "pipeline" if parallel.tensor_parallel_size == 1 else "tensor x pipeline"
    return ray_rank_memories(parallel.world_size, kind + " parallel")
