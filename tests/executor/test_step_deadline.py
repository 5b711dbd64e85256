"""The step deadline (executor/deadline.py) on the real Qwen2-7B shapes, and the step watchdog
(engine/step_watchdog.py) as a component: it reports a step that outlives its deadline, once,
from its own thread, and stays quiet for steps that end in time."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.step_watchdog import StepWatchdog
from pagedllm.executor.deadline import FIRST_STEPS, FIRST_STEPS_FACTOR, StepDeadline
from pagedllm.loader.checkpoint import resolve_checkpoint

QWEN7B_SHAPES = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes"


def test_a_7b_prefill_chunk_gets_its_work_and_a_decode_step_the_base():
    arch = resolve_checkpoint(QWEN7B_SHAPES).arch
    deadline = StepDeadline(30.0, 2.0 * arch.num_params())
    # 256 tokens x 15.2 GFLOP at 20 GFLOP/s: ~195 s over the base (two vCPUs take ~20 s)
    assert 220 < deadline.seconds(256, FIRST_STEPS) < 230
    assert 30 < deadline.seconds(1, FIRST_STEPS) < 31
    assert deadline.seconds(256, 0) == pytest.approx(FIRST_STEPS_FACTOR
                                                     * deadline.seconds(256, FIRST_STEPS))


@pytest.mark.parametrize("value", [-1, "30", True])
def test_a_bad_step_timeout_is_refused_by_name(value):
    with pytest.raises(ValueError, match="step_timeout must be a number of seconds"):
        EngineArgs(model="x", step_timeout=value)


def test_the_watchdog_reports_a_step_past_its_deadline_once_and_not_one_in_time():
    reasons: list[tuple[str, str]] = []
    fired = threading.Event()

    def on_hung(reason: str) -> None:
        reasons.append((reason, threading.current_thread().name))
        fired.set()

    watch = StepWatchdog(on_hung)
    try:
        for _ in range(20):  # steps that end in time
            watch.begin(0.5)
            time.sleep(0.005)
            watch.end()
        time.sleep(0.6)
        assert not reasons
        started = time.monotonic()
        watch.begin(0.2)  # this one never ends
        assert fired.wait(5)
        assert 0.2 <= time.monotonic() - started < 2
        time.sleep(0.3)
        (reason, thread), = reasons
        assert "has not returned within its deadline of 0.2 s" in reason and "hung" in reason
        assert thread == "pagedllm-step-watchdog"
    finally:
        watch.stop()


def test_a_late_step_is_reported_once_whichever_thread_sees_it_first():
    reasons: list[str] = []
    watch = StepWatchdog(reasons.append)
    try:
        watch.begin(0.05)
        time.sleep(0.3)  # the watchdog reports it, or end() does if it could not run
        watch.end()
        watch.begin(0.05)  # after a report the engine is stopped: nothing more is said
        time.sleep(0.2)
        watch.end()
        assert len(reasons) == 1 and "deadline of 0.05 s" in reasons[0]
    finally:
        watch.stop()
