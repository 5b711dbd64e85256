"""How long one step may take before the engine calls it hung, and how a rank that misses it
is reported (WorkerHungError): the executors' deadline on their ranks' replies and the
engine's step watchdog (engine/step_watchdog.py) share it.

A step's legitimate time grows with its work, so the deadline is `step_timeout` seconds plus
the step's work at MIN_FLOPS. The slowest step this has to allow is a full prefill chunk of a
7B model on two vCPUs: a Qwen2-7B-shaped model does ~15 GFLOP a token, 256 tokens (the
server's chunk) ~3.9 TFLOP, which those two cores compute at ~200 GFLOP/s in ~20 s; at
MIN_FLOPS, ten times slower, the chunk is allowed 195 s + step_timeout. A decode step of the
same model (a few tokens) gets step_timeout and a little. The first steps warm up (pages of
mapped weights read from disk, thread pools, kernels' first calls): FIRST_STEPS_FACTOR times
more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.config import EngineConfig

MIN_FLOPS = 20e9  # the slowest speed a working engine computes at: a tenth of 2 Zen 4 vCPUs'
FIRST_STEPS = 4  # steps that get FIRST_STEPS_FACTOR times the deadline
FIRST_STEPS_FACTOR = 4.0
# the engine's watchdog waits this much longer than an executor that watches its ranks'
# replies, so that the executor's failure, which names the rank and stops the ranks, comes first
WATCHDOG_GRACE_S = 5.0


@dataclass(frozen=True)
class StepDeadline:
    """A step's deadline: base_s plus its tokens' work at MIN_FLOPS; the first steps longer."""

    base_s: float  # step_timeout
    flops_per_token: float  # 2 x the model's parameters

    @classmethod
    def of(cls, config: EngineConfig) -> Optional["StepDeadline"]:
        """The deadline config.step_timeout asks for; None: steps are not timed."""
        if not config.step_timeout:
            return None
        # a draft model runs in the step too, over about as many tokens as the target
        draft = 0 if config.draft is None else config.draft.arch.num_params()
        return cls(float(config.step_timeout), 2.0 * (config.arch.num_params() + draft))

    def seconds(self, tokens: int, steps_done: int) -> float:
        """How long a step of `tokens` tokens may take, after `steps_done` steps."""
        allowed = self.base_s + tokens * self.flops_per_token / MIN_FLOPS
        return allowed * FIRST_STEPS_FACTOR if steps_done < FIRST_STEPS else allowed


class StepDeadlines:
    """The deadline of each step in the order its owner meets them (the first FIRST_STEPS
    longer): one count of steps, for an executor's replies or the engine's watchdog."""

    def __init__(self, config: EngineConfig) -> None:
        self._deadline = StepDeadline.of(config)
        self._steps = 0

    @property
    def enabled(self) -> bool:
        """Whether steps are timed (step_timeout set)."""
        return self._deadline is not None

    def next(self, num_scheduled_tokens: dict[str, int]) -> Optional[float]:
        """The deadline of the next step (SchedulerOutput.num_scheduled_tokens); None: not
        timed."""
        if self._deadline is None:
            return None
        seconds = self._deadline.seconds(step_tokens(num_scheduled_tokens), self._steps)
        self._steps += 1
        return seconds


class WorkerHungError(RuntimeError):
    """A rank did not answer a step within its deadline (stopped or hung)."""


def hung_message(name: str, waited: float, deadline: float, state: str) -> str:
    """Why an executor gave up on a rank (the mp and the Ray executors say it alike)."""
    return (f"{name}{state} has not answered for {waited:.1f} s (this step's deadline: "
            f"{deadline:.3g} s, from step_timeout): stopped or hung? The engine cannot "
            "continue; its ranks are stopped")


def process_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a debugger), not merely slow."""
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED,
                                                 psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def step_tokens(num_scheduled_tokens: dict[str, int]) -> int:
    """Tokens a step computes, from SchedulerOutput.num_scheduled_tokens."""
    return sum(num_scheduled_tokens.values())
