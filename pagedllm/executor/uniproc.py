"""The executor of one worker in the engine's own process."""
from __future__ import annotations

from typing import Any

from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """One Worker, called directly."""

    def _init_executor(self) -> None:
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()

    def kv_block_bytes(self) -> int:
        return self.worker.kv_block_bytes()

    def determine_available_memory(self) -> int:
        return self.worker.determine_available_memory()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def decode_path(self) -> str:
        return self.worker.model_runner.decode_path

    @property
    def model_runner(self):
        """The worker's model runner (in-process only: for tests and benchmarks)."""
        return self.worker.model_runner
