"""The step watchdog: a thread of its own that declares the engine hung when one step outlives
its deadline (executor/deadline.py). A step stuck in a kernel, a lock or a wait on a peer
cannot notice it itself; this thread can, and the engine's owner then fails every request and
stops (a server answers /health 503 with the reason and exits 1, so a supervisor restarts it).

    engine thread:  begin(8.2 s) ... step ... end()   begin(8.2 s) ... step (stuck) ...
    watchdog:               waits until end or 8.2 s                  8.2 s -> on_hung(reason)

A step that returns past its deadline before this thread got to run (a loaded machine) is
reported by end() itself: the rule is the deadline, whichever thread sees it broken first.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("pagedllm")
WHY = "(step_timeout plus its work at a floor speed)"


class StepWatchdog:
    """Calls on_hung(reason) once, from its own thread, when a step outlives its deadline."""

    def __init__(self, on_hung: Callable[[str], None]) -> None:
        self._on_hung = on_hung
        self._cond = threading.Condition()
        self._due: Optional[float] = None  # monotonic time the running step must end by
        self._deadline_s = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def begin(self, deadline_s: float) -> None:
        """A step starts (engine thread); it must end within deadline_s seconds."""
        with self._cond:
            self._due, self._deadline_s = time.monotonic() + deadline_s, deadline_s
            self._cond.notify()

    def end(self) -> None:
        """The step returned (or raised); late, it is reported here."""
        with self._cond:
            now, due = time.monotonic(), self._due
            self._due = None
            if due is None or now <= due or self._stopped:
                return
            self._stopped = True
            took = now - due + self._deadline_s
            reason = (f"an engine step returned after {took:.3g} s, past its deadline of "
                      f"{self._deadline_s:.3g} s {WHY}: the engine is hung or too slow")
        self._report(reason)

    def stop(self) -> None:
        """Stop watching (the engine shuts down)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._due is None:
                    self._cond.wait()
                    continue
                left = self._due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)  # woken early by the next begin() or stop()
                    continue
                self._stopped = True
                reason = (f"an engine step has not returned within its deadline of "
                          f"{self._deadline_s:.3g} s {WHY}: the engine is hung")
                break
            else:
                return
        self._report(reason)

    def _report(self, reason: str) -> None:
        logger.error("%s", reason)
        self._on_hung(reason)
