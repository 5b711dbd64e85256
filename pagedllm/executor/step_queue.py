"""The steps an executor has sent its ranks and not yet answered, oldest first: the executor's
side of vLLM's batch queue, shared by the mp and Ray executors.

Every rank serves its calls in order, so the replies come oldest step first. The rank that
samples (the driver) answers each step with its tokens; every rank gets them in the scheduler's
next message for the request (core/sched_output.CachedRequestData.new_token_ids: a request is
in at most one step in flight, so its token is known before it is scheduled again)."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from pagedllm.core.outputs import ModelRunnerOutput


class PendingStep:
    """A step sent to every rank (`handle`: what the executor needs to read its replies); its
    output once read."""

    def __init__(self, queue: "StepQueue", handle: Any) -> None:
        self._queue = queue
        self.handle = handle
        self.output: Optional[ModelRunnerOutput] = None

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's output (and those of the steps sent before it)."""
        return self._queue.wait(self)


class StepQueue:
    """Steps in flight, oldest first."""

    def __init__(self, take_oldest: Callable[[Any], ModelRunnerOutput]) -> None:
        """take_oldest(handle): the driver's output of the oldest step in flight, read from the
        ranks (it blocks, and raises the executor's failure when a rank died)."""
        self._take_oldest = take_oldest
        self._steps: deque[PendingStep] = deque()

    def __len__(self) -> int:
        """Steps in flight."""
        return len(self._steps)

    def submit(self, handle: Any) -> PendingStep:
        """Record a step just sent to every rank."""
        step = PendingStep(self, handle)
        self._steps.append(step)
        return step

    def wait(self, step: PendingStep) -> ModelRunnerOutput:
        """Read the steps in flight, oldest first, until `step` has its output."""
        while step.output is None:
            out = self._take_oldest(self._steps[0].handle)
            self._steps.popleft().output = out
        return step.output

    def drain(self) -> None:
        """Read every step in flight (before a call that is not a step)."""
        if self._steps:
            self.wait(self._steps[-1])
