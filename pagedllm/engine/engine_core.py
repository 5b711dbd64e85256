"""EngineCore: the step loop (schedule, execute, update) over an executor."""
from __future__ import annotations

import logging
from typing import Iterable, Optional

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.executor import Executor, executor_class as default_executor_class

logger = logging.getLogger("pagedllm")


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
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.arch.vocab_size)

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
        """Anything waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report each request's progress."""
        sched = self.scheduler.schedule()
        out = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, out)

    def shutdown(self) -> None:
        """Stop the executor's workers."""
        self.executor.shutdown()
