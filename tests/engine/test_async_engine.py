"""AsyncLLM: concurrent streams share the engine, early close aborts, a bounded waiting queue, a
stream left untaken is aborted past its backlog bound."""
from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import (BACKLOG_GRACE_S, AsyncLLM, EngineOverloadedError,
                                          EngineStats, StreamBackloggedError)
from pagedllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    return LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf), dtype="float32",
                                                 max_num_seqs=1, max_model_len=512))


def test_streams_and_overload(engine):
    async def main():
        llm = AsyncLLM(engine, max_waiting=2)
        try:
            assert llm.stats() == EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0)
            assert llm.vocab_size == 49152  # SmolLM2's
            # a long request holds the only sequence slot, so the next ones wait
            hog = llm.add_request("hog", "Hello there", SamplingParams(max_tokens=2000,
                                                                     ignore_eos=True))
            await hog.__anext__()
            stats = llm.stats()
            assert stats.num_running == 1 and 0 < stats.kv_cache_usage < 1
            streams = [llm.add_request(f"r{i}", "Hello there", GREEDY) for i in range(2)]
            with pytest.raises(EngineOverloadedError, match="2 requests are already waiting"):
                llm.add_request("r2", "Hello there", GREEDY)
            await hog.aclose()  # closing a stream early aborts its request
            await streams[0].__anext__()  # r0 now runs: one slot in the queue again
            streams.append(llm.add_request("r2", "Hello there", GREEDY))
            outs = []
            for s in streams:
                async for out in s:
                    pass
                outs.append(out.outputs[0].token_ids)
            assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8
            # an aborted request's blocks go back to the pool
            s = llm.add_request("early", "Hello there", SamplingParams(max_tokens=500,
                                                                       ignore_eos=True))
            async for _ in s:
                break
            await s.aclose()
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            assert not engine.has_unfinished_requests()
            assert llm.stats().kv_cache_usage == 0
            with pytest.raises(ValueError, match="max_model_len is 512"):
                llm.add_request("bad", "hello " * 2000, GREEDY)
            assert llm._pending == 0
        finally:
            llm.shutdown()

    asyncio.run(main())


async def _until_idle(engine, seconds: float = 10.0) -> float:
    """Seconds until the engine has nothing left to do (fails past `seconds`)."""
    started = time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - started < seconds, "the request was not aborted"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_a_stream_left_untaken_is_aborted_and_its_blocks_freed(engine):
    async def main():
        llm = AsyncLLM(engine, max_stream_backlog=4)
        closed = []
        try:
            long = SamplingParams(max_tokens=400, ignore_eos=True)
            stream = llm.add_request("slow", "Hello there", long,
                                     on_close=lambda: closed.append("slow"))
            await stream.__anext__()  # then never taken again, as a client that does not read
            waited = await _until_idle(engine)
            assert BACKLOG_GRACE_S * 0.9 < waited < 8  # the grace, then the abort
            assert llm.stats().kv_cache_usage == 0 and closed == ["slow"]
            assert len(llm._streams) == 0
            # the backlog is dropped; the caller, if it reads again, hears why
            with pytest.raises(StreamBackloggedError, match="max-stream-backlog"):
                await stream.__anext__()
            assert closed == ["slow"]  # on_close ran once
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_a_burst_after_a_busy_event_loop_is_not_a_backlog(engine):
    async def main():
        llm = AsyncLLM(engine, max_stream_backlog=2)
        try:
            stream = llm.add_request("burst", "Hello there",
                                     SamplingParams(max_tokens=60, ignore_eos=True,
                                                    output_kind=RequestOutputKind.DELTA))
            await stream.__anext__()
            time.sleep(BACKLOG_GRACE_S + 0.5)  # the loop is held up: outputs pile up behind it
            tokens = 1
            async for out in stream:  # a live caller takes them in one go
                tokens += len(out.outputs[0].token_ids)
            assert out.finished and tokens == 60
        finally:
            llm.shutdown()

    asyncio.run(main())
