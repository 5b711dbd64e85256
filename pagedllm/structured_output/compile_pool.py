"""Worker threads with a large stack, where grammars are compiled.

llguidance's compiler recurses on the calling thread's stack: a 3,000-rule chain overflows an
ordinary 8 MB thread stack and the process dies (SIGSEGV). On these threads the 10,000-rule
chain compiles in 0.4 s. The compiler releases the GIL, so the event loop and the engine thread
run on meanwhile. A compile cannot be interrupted: one that outlives its caller's deadline keeps
its worker until it ends, which is why the queue in front of the workers is bounded.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Callable, TypeVar

T = TypeVar("T")

# virtual size: a thread touches only the pages it uses. The 10,000-rule chain needs 16-32 MB
# (measured); the default caps (2,000 rules, 2,000 schema nodes) stay far below
STACK_BYTES = 256 * 1024**2
NUM_WORKERS = 2  # compiles at once
MAX_QUEUED = 8  # compiles waiting for a worker; beyond that submit() refuses
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide


class CompileBusyError(RuntimeError):
    """Every grammar worker is busy and the queue is full (the server answers 503)."""


class CompilePool:
    """A bounded queue in front of a few large-stack threads, started on first use."""

    def __init__(self, num_workers: int = NUM_WORKERS, max_queued: int = MAX_QUEUED) -> None:
        self._num_workers, self._max_queued = num_workers, max_queued
        self._jobs: SimpleQueue = SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._in_flight = 0  # queued or running

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        return self._in_flight

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        """Run fn() on a worker; CompileBusyError if the workers and the queue are full."""
        with self._lock:
            if self._in_flight >= self._num_workers + self._max_queued:
                raise CompileBusyError(
                    f"the grammar compiler is busy: {self._in_flight} constraints are being "
                    "compiled or waiting; retry later")
            self._in_flight += 1
            if len(self._threads) < min(self._in_flight, self._num_workers):
                self._start_worker()
        future: Future = Future()
        self._jobs.put((future, fn))
        return future

    def _start_worker(self) -> None:
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(STACK_BYTES)
            try:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"pagedllm-grammar-{len(self._threads)}")
                thread.start()  # the stack size is read here
            finally:
                threading.stack_size(previous)
        self._threads.append(thread)

    def _work(self) -> None:
        while True:
            future, fn = self._jobs.get()
            try:
                if future.set_running_or_notify_cancel():  # False: cancelled while queued
                    try:
                        future.set_result(fn())
                    except BaseException as err:  # the caller's to handle
                        future.set_exception(err)
            finally:
                with self._lock:
                    self._in_flight -= 1
