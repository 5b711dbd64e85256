"""Executors: how the engine core reaches its workers (one in this process, or one process per
pipeline rank; a Ray cluster later, behind the same interface)."""
from __future__ import annotations

from pagedllm.config import ParallelConfig
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor


def executor_class(parallel: ParallelConfig) -> type[Executor]:
    """The executor for a parallel config's backend: "uni" in-process, "mp" one process per
    rank."""
    return UniProcExecutor if parallel.backend == "uni" else MultiprocExecutor
