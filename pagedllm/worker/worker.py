"""Worker: one model runner on one device, in the process that owns that device."""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner


class Worker:
    """Sets up its device, then serves the executor's calls through its model runner."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner: Optional[ModelRunner] = None  # made by init_device

    def init_device(self) -> None:
        """Threads, allocator, seed and compiled kernels, then the runner: which code the runner
        and the model's layers run depends on the kernels being loaded."""
        platform = self.config.platform
        platform.init_device()
        torch.manual_seed(self.config.seed)
        platform.load_kernels()  # cached: the config builder has usually loaded them already
        self.model_runner = ModelRunner(self.config)

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
        """Run one scheduled step."""
        return self.model_runner.execute_model(sched)
