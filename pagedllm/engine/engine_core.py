"""EngineCore: the step loop (schedule, execute, update) over an executor.

With an executor that runs several steps at once (pipeline stages in their own processes:
max_concurrent_batches > 1), a step keeps up to that many scheduled batches in flight (vLLM's
batch queue): while there is room and schedulable work it submits a batch and returns with no
outputs; when the queue is full or nothing more can be scheduled it waits for the oldest batch,
updates from it and submits the next before returning its progress (the caller detokenizes
while the stages compute). Stage 0 then computes batch k+1 while stage 1 computes batch k.

With a watch (the server's step watchdog), every wait on the executor is timed against the
step's deadline (executor/deadline.py): a step that does not come back in time is reported
from the watch's own thread, since the waiting thread is the one that is stuck.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.spec_decode import Speculator
from pagedllm.executor import Executor, executor_class as default_executor_class
from pagedllm.executor.abstract import StepFuture
from pagedllm.executor.deadline import WATCHDOG_GRACE_S, StepDeadlines

logger = logging.getLogger("pagedllm")


class StepWatch(Protocol):
    """Times each wait on the executor (engine/step_watchdog.py's StepWatchdog)."""

    def begin(self, deadline_s: float) -> None: ...

    def end(self) -> None: ...


class EngineCore:
    """Owns the executor and the scheduler; one step() is one forward pass."""

    def __init__(self, config: EngineConfig,
                 executor_class: Optional[type[Executor]] = None) -> None:
        """executor_class: None picks the one config.parallel asks for."""
        self.config = config
        self.executor = (executor_class or default_executor_class(config.parallel))(config)
        try:
            num_blocks = self._initialize_kv_cache()
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                         config.cache.enable_prefix_caching)
        speculator = None
        if config.speculative is not None:
            draft = config.draft  # a draft step costs about its share of the parameters
            speculator = Speculator(config.speculative, draft_cost=0.0 if draft is None else
                                    draft.arch.num_params() / config.arch.num_params())
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.arch.vocab_size,
                                   speculator)
        # batches submitted and not updated yet, oldest first; None: one step at a time
        self.batch_queue: Optional[deque[tuple[SchedulerOutput, StepFuture]]] = (
            deque() if self.executor.max_concurrent_batches > 1 else None)
        self.max_batches_in_flight = 0  # the most batches seen in flight at once
        self.deadlines = StepDeadlines(config)
        self.watch: Optional[StepWatch] = None  # set by whoever watches for a hung step

    def _initialize_kv_cache(self) -> int:
        """Size the KV cache from what the workers may hold, allocate it; the number of blocks."""
        available = self.executor.determine_available_memory()
        num_blocks = available // self.executor.kv_block_bytes()
        if num_blocks <= 0:
            raise ValueError(f"no memory left for the KV cache ({available} bytes)")
        self.executor.initialize_kv_cache(num_blocks)
        return num_blocks

    def add_request(self, request: Request) -> None:
        """Queue a request."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests and free their KV blocks now."""
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Anything waiting or running, or a batch in flight."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report each request's progress. With a batch
        queue: submit a batch or take the oldest one's progress (possibly none)."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        sched = self.scheduler.schedule()
        started = time.perf_counter()
        with self._timed(sched):
            out = self.executor.execute_model(sched)
        speculator = self.scheduler.speculator
        if speculator is not None and not sched.is_empty:  # what a verify row costs here
            speculator.observe_step(sched, time.perf_counter() - started - out.draft_seconds)
        return self.scheduler.update_from_output(sched, out)

    @contextmanager
    def _timed(self, sched: SchedulerOutput) -> Iterator[None]:
        """Let the watch time the executor's answer to `sched` against its deadline (a little
        longer where the executor times its ranks itself, so that its failure, naming the rank,
        comes first)."""
        watch = self.watch
        if watch is None or not self.deadlines.enabled:
            yield
            return
        seconds = self.deadlines.next(sched.num_scheduled_tokens)
        watch.begin(seconds + (WATCHDOG_GRACE_S if self.executor.watches_ranks else 0.0))
        try:
            yield
        finally:
            watch.end()

    def _step_with_batch_queue(
            self, queue: deque[tuple[SchedulerOutput, StepFuture]]) -> list[EngineCoreOutput]:
        """Submit a new batch if the queue has room and the scheduler has work, and return at
        once; otherwise wait for the oldest batch, update from it, and submit the next batch
        before returning its progress, so the stages compute while the caller handles it."""
        if len(queue) < self.executor.max_concurrent_batches and self._submit(queue):
            return []
        if not queue:
            return []
        sched, future = queue.popleft()
        with self._timed(sched):
            out = future.result()
        outputs = self.scheduler.update_from_output(sched, out)
        self._submit(queue)
        return outputs

    def _submit(self, queue: deque[tuple[SchedulerOutput, StepFuture]]) -> bool:
        """Schedule a batch and submit it if it has work (the scheduler keeps the finished
        ids of an empty one for the next); whether it did."""
        sched = self.scheduler.schedule(self.executor.max_concurrent_batches)
        if sched.is_empty:
            return False
        queue.append((sched, self.executor.execute_model_async(sched)))
        self.max_batches_in_flight = max(self.max_batches_in_flight, len(queue))
        return True

    def shutdown(self) -> None:
        """Stop the executor's workers."""
        self.executor.shutdown()
