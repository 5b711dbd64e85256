"""The server's log: a line per finished request, and vLLM's throughput line while busy.

    AsyncLLM --first_token / next_tokens / finished--> OutputListeners --> ServerMetrics (/metrics)
                                                                       --> RequestLog (log lines)
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, Optional

from pagedllm.core.spec_decode import SpecStats
from pagedllm.engine.async_engine import EngineStats, OutputListener

logger = logging.getLogger("pagedllm")


class OutputListeners:
    """Several OutputListeners as one (AsyncLLM calls one)."""

    def __init__(self, listeners: Iterable[Optional[OutputListener]]) -> None:
        self.listeners = [listener for listener in listeners if listener is not None]

    def first_token(self, prompt_tokens: int, num_tokens: int, seconds: float) -> None:
        """A request's first output tokens reached its client."""
        for listener in self.listeners:
            listener.first_token(prompt_tokens, num_tokens, seconds)

    def next_tokens(self, num_tokens: int, seconds: float) -> None:
        """More tokens of a request reached its client."""
        for listener in self.listeners:
            listener.next_tokens(num_tokens, seconds)

    def finished(self, request_id: str, prompt_tokens: int, generation_tokens: int,
                 seconds: float) -> None:
        """A request ended."""
        for listener in self.listeners:
            listener.finished(request_id, prompt_tokens, generation_tokens, seconds)


class RequestLog:
    """Logs each finished request (unless log_requests is False) and counts the tokens of the
    periodic throughput line. Called on the event loop only, so it needs no lock."""

    def __init__(self, log_requests: bool = True) -> None:
        self.log_requests = log_requests
        self._prompt_tokens = 0  # since the last throughput line
        self._generation_tokens = 0
        self._since = time.monotonic()
        self._spec: Optional[SpecStats] = None  # speculation's counts at the last stats line

    def first_token(self, prompt_tokens: int, num_tokens: int, seconds: float) -> None:
        """The prompt has been computed and the first tokens sent."""
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += num_tokens

    def next_tokens(self, num_tokens: int, seconds: float) -> None:
        """More output tokens were sent."""
        self._generation_tokens += num_tokens

    def finished(self, request_id: str, prompt_tokens: int, generation_tokens: int,
                 seconds: float) -> None:
        """One INFO line: id, token counts, time from arrival to the end, output tok/s."""
        if generation_tokens == 0:  # no first token counted its prompt
            self._prompt_tokens += prompt_tokens
        if self.log_requests:
            logger.info("Finished request %s: %d prompt tokens, %d output tokens in %.2f s "
                        "(%.1f output tok/s)", request_id, prompt_tokens, generation_tokens,
                        seconds, generation_tokens / seconds if seconds > 0 else 0.0)

    def stats_line(self, stats: EngineStats) -> Optional[str]:
        """vLLM's throughput line over the tokens counted since the last call (which it
        resets), and with speculative decoding vLLM's SpecDecoding line on a line of its own;
        None when nothing ran in the meantime."""
        now = time.monotonic()
        elapsed = max(now - self._since, 1e-9)
        prompt, generation = self._prompt_tokens, self._generation_tokens
        self._prompt_tokens = self._generation_tokens = 0
        self._since = now
        spec = None
        if stats.spec is not None:
            spec = stats.spec if self._spec is None else stats.spec.since(self._spec)
            self._spec = stats.spec
        if not (prompt or generation or stats.num_running or stats.num_waiting):
            return None
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation "
                f"throughput: {generation / elapsed:.1f} tokens/s, Running: {stats.num_running}"
                f" reqs, Waiting: {stats.num_waiting} reqs, KV cache usage: "
                f"{stats.kv_cache_usage:.1%}")
        if spec is not None and spec.num_drafts:  # vLLM logs it as a line of its own
            line += "\n" + spec.log_line(elapsed)
        return line

    async def log_stats_every(self, seconds: float, stats: Callable[[], EngineStats]) -> None:
        """Log the throughput line every `seconds` while busy, until cancelled."""
        self.stats_line(stats())  # start the first window now
        while True:
            await asyncio.sleep(seconds)
            line = self.stats_line(stats())
            for part in (line or "").splitlines():  # speculation's counts: a line of their own
                logger.info("%s", part)
