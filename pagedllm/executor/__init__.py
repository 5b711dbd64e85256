"""Executors: how the engine core reaches its workers (one in this process, one local process
per pipeline rank, or one Ray actor per rank on a Ray cluster), behind one interface."""
from __future__ import annotations

from pagedllm.config import ParallelConfig
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor


def executor_class(parallel: ParallelConfig) -> type[Executor]:
    """The executor for a parallel config's backend: "uni" in-process, "mp" one process per
    rank, "ray" one Ray actor per rank (Ray, an optional extra, imported only then)."""
    if parallel.backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    return UniProcExecutor if parallel.backend == "uni" else MultiprocExecutor
