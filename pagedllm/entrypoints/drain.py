"""The server's way out: on SIGTERM it drains, on an engine failure it shows why, then stops.

    SIGTERM ─> new requests 503, /health 503 ─> open streams finish, up to --shutdown-timeout
            ─> the rest: an error event (503) and [DONE]; non-streaming ones a 503 ─> exit 0
    engine stopped or hung ─> streams already failed ─> /health 503 with the reason for
            FATAL_LINGER_S (a probe polling it sees why) ─> exit 1
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the engine (and torch) is not imported by the command line's start
    from pagedllm.engine.async_engine import AsyncLLM

logger = logging.getLogger("pagedllm")

DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0  # under Kubernetes' default 30 s grace before SIGKILL
FATAL_LINGER_S = 0.5
POLL_S = 0.05


async def drain(engine: AsyncLLM, timeout_s: float, forced: Callable[[], bool]) -> None:
    """Refuse new requests, give the open streams up to timeout_s seconds to finish, then end
    the rest with an error; forced(): a second signal, stop waiting."""
    if engine.error is not None:
        await asyncio.sleep(FATAL_LINGER_S)
        return
    engine.close("the server is shutting down; send the request to another server")
    started, open_at_start = time.monotonic(), engine.num_streams
    if open_at_start:
        logger.info("shutting down: %d requests may finish within %.0f s (--shutdown-timeout)",
                    open_at_start, timeout_s)
    while (engine.num_streams and time.monotonic() - started < timeout_s and not forced()
           and engine.error is None):
        await asyncio.sleep(POLL_S)
    left = engine.num_streams
    if left:
        engine.fail_streams(f"the server is shutting down: the request did not finish within "
                            f"--shutdown-timeout {timeout_s:g} s")
        logger.warning("shutting down: %d of %d requests did not finish within %.1f s; each "
                       "got an error (a stream: an error event and [DONE])", left, open_at_start, time.monotonic() - started)
    elif open_at_start:
        logger.info("shutting down: every request finished, in %.1f s",
                    time.monotonic() - started)
