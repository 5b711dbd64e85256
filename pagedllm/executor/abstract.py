"""The executor interface the engine core talks to."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process exited or was killed: the engine cannot go on."""


class WorkerError(RuntimeError):
    """A worker process raised while serving a call."""


class StepFuture(Protocol):
    """A step submitted to the workers; result() waits for its ModelRunnerOutput."""

    def result(self) -> ModelRunnerOutput:
        """The step's output (raises the executor's failure if a worker died)."""


class DoneStep:
    """A step that ran before it was handed back (an executor with one batch in flight)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        """The step's output."""
        return self._output


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

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once: pipeline_parallel_size where the stages run
        in their own processes (stage 0 computes batch k+1 while stage 1 computes batch k);
        1 otherwise."""
        return 1

    def execute_model_async(self, sched: SchedulerOutput) -> StepFuture:
        """Submit one scheduled step; its output comes from the future's result(). Steps
        complete in the order they were submitted. Here: it runs now."""
        return DoneStep(self.execute_model(sched))

    @property
    def watches_ranks(self) -> bool:
        """Whether this executor fails a step whose ranks do not answer within its deadline
        (executor/deadline.py), naming the rank; the engine's watchdog then waits a little
        longer, so that this more precise failure comes first."""
        return False

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run a Worker method on every worker (after the steps in flight); the answers in rank
        order (vLLM's name)."""

    @abstractmethod
    def decode_path(self) -> str:
        """What runs decode-only steps on the workers, and why (one line for the log)."""

    def shutdown(self) -> None:
        """Stop the workers (nothing to do in-process)."""
