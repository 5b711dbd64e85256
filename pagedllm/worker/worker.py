"""Worker: one model runner on one device, in the process that owns that device."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.distributed.stage import PipelineStage
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


class Worker:
    """Sets up its device, then serves the executor's calls through its model runner."""

    def __init__(self, config: EngineConfig, stage: Optional[PipelineStage] = None,
                 tp: Optional[TensorParallelRank] = None,
                 num_threads: Optional[int] = None) -> None:
        """stage: this worker's pipeline stage, or None: the whole model in one process; tp:
        its tensor parallel rank, or None. num_threads: torch threads (a Ray rank: its node's
        cores over the ranks placed there); None: this machine's threads, shared among the
        ranks."""
        self.config = config
        self.stage = stage
        self.tp = tp
        self.num_threads = num_threads
        self.model_runner: Optional[ModelRunner] = None  # made by init_device

    def init_device(self) -> None:
        """Threads, allocator, seed and compiled kernels, then the runner: which code the runner
        and the model's layers run depends on the kernels being loaded."""
        platform = self.config.platform
        platform.init_device()
        world = self.config.parallel.world_size
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        elif world > 1:
            # the ranks of one machine share its cores: all of them each would oversubscribe
            threads = max(1, torch.get_num_threads() // world)
            torch.set_num_threads(threads)
            where = ([] if self.stage is None else [f"pipeline rank {self.stage.rank}"]) + (
                [] if self.tp is None else [f"tensor parallel rank {self.tp.rank}"])
            logger.info("%s of %d ranks: %d threads", ", ".join(where), world, threads)
        torch.manual_seed(self.config.seed)
        platform.load_kernels()  # cached: the config builder has usually loaded them already
        self.model_runner = ModelRunner(self.config, self.stage, self.tp)

    def load_model(self) -> None:
        """Build the model and load its weights."""
        self.model_runner.load_model()

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this worker."""
        return self.model_runner.kv_block_bytes()

    def determine_available_memory(self) -> int:
        """Bytes this worker may give the KV cache."""
        return self.model_runner.determine_available_memory()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks."""
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step (the same message on every rank)."""
        return self.model_runner.execute_model(sched)

    def comm_stats(self, reset: bool = False) -> dict:
        """This rank's stage-to-stage send/recv counters (worker/stage_comm.py) and its tensor
        parallel collectives' (distributed/comm_stats.py); reset=True starts them again."""
        from pagedllm.distributed.comm_stats import TP_COMM_STATS
        from pagedllm.worker.stage_comm import COMM_STATS

        return {**COMM_STATS.snapshot(reset), **TP_COMM_STATS.snapshot(reset)}
