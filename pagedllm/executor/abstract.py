"""The executor interface the engine core talks to."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput


class Executor(ABC):
    """Starts the workers, loads the model on each, sizes and allocates their KV caches, and runs
    each scheduled step on all of them. With several workers (tensor or pipeline ranks) the
    memory answers are the smallest over workers and the output is the last rank's."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: device set-up, then the model load."""

    @abstractmethod
    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes on a worker."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes each worker may give its KV cache."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step."""

    @abstractmethod
    def decode_path(self) -> str:
        """What runs decode-only steps on the workers, and why (one line for the log)."""

    def shutdown(self) -> None:
        """Stop the workers (nothing to do in-process)."""
