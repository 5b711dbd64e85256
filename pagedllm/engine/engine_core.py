"""EngineCore: the step loop — schedule, execute, update."""
from __future__ import annotations

from typing import Iterable

from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.model_runner import ModelRunner


class EngineCore:
    """Owns the scheduler and the model runner; one step() is one forward pass."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request: Request) -> None:
        """Queue a request."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests and free their KV blocks now."""
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Anything waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report each request's progress."""
        sched = self.scheduler.schedule()
        out = self.runner.execute(sched)
        return self.scheduler.update_from_output(sched, out)
