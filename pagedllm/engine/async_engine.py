"""AsyncLLM: one engine thread keeps stepping while asyncio callers add, stream and abort requests.

    event loop (HTTP handlers)                engine thread
    generate() --validate--> inbox  ------->  add_processed, step(), step(), ...
               <---- RequestOutput via call_soon_threadsafe ----  (one queue per request)
    abort()    ---------------> inbox  ------>  abort_request (frees KV blocks at once)

A caller that stops taking its stream's outputs (an HTTP client that does not read) would make
its queue grow by one output a step and hold its sequence slots to max_tokens: past
max_stream_backlog outputs not taken, and nothing taken for BACKLOG_GRACE_S, the request is
aborted and its queue emptied.

A watchdog thread (engine/step_watchdog.py) times each step: one that outlives its deadline
fails every open stream with EngineHungError and calls on_fatal, as an engine thread that
raised does. close() and fail_streams() are the server's drain on SIGTERM.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Protocol

from pagedllm.config import DEFAULT_MAX_STREAM_BACKLOG
from pagedllm.core.spec_decode import SpecStats
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.step_watchdog import StepWatchdog
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_output.grammar import CompiledGrammar

logger = logging.getLogger("pagedllm")

# idle seconds before the grammar warm-up runs: a health probe or first request right after
# start-up is not held up by it
WARM_UP_DELAY_S = 1.0
# a stream past its backlog bound is aborted only once its caller has taken nothing for this
# long: an event loop held up for a moment delivers a burst of outputs at once, which a live
# caller then takes in one go
BACKLOG_GRACE_S = 1.0


class OutputListener(Protocol):
    """Receives per-request timing as outputs reach callers (e.g. Prometheus metrics)."""

    def first_token(self, prompt_tokens: int, num_tokens: int, seconds: float) -> None: ...

    def next_tokens(self, num_tokens: int, seconds: float) -> None: ...

    def finished(self, request_id: str, prompt_tokens: int, generation_tokens: int,
                 seconds: float) -> None: ...


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error."""


class EngineHungError(RuntimeError):
    """A step outlived its deadline: the engine is stuck and stops."""


class EngineClosingError(EngineOverloadedError):
    """The engine's owner is shutting it down: no new requests, or one cut at the end of the
    drain (served as 503, as an overload is)."""


class RequestFailedError(RuntimeError):
    """One request failed on its own (e.g. detokenizing its output); the engine goes on."""


class StreamBackloggedError(RequestFailedError):
    """A request aborted because its caller left more than max_stream_backlog outputs untaken."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for metrics."""

    num_running: int  # sequences being computed
    num_waiting: int  # sequences queued or preempted
    kv_cache_usage: float  # fraction of KV-cache blocks in use (0-1)
    running_loras: tuple[str, ...] = ()  # names of the LoRA adapters of running requests
    waiting_loras: tuple[str, ...] = ()  # and of waiting ones
    spec: Optional[SpecStats] = None  # speculative decoding's counts since start (None: off)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    on_close: Optional[Callable[[], None]] = None  # called once, when the stream is forgotten
    # loop time of the caller's last take, or of the output that found the queue empty if later
    idle_since: float = 0.0


class AsyncLLM:
    """Thread-backed asynchronous front of an LLMEngine; requests share batches."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG) -> None:
        if isinstance(max_stream_backlog, bool) or not isinstance(max_stream_backlog, int) \
                or max_stream_backlog < 1:
            raise ValueError(f"max_stream_backlog must be an int >= 1, got {max_stream_backlog!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_stream_backlog = max_stream_backlog
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # requests accepted but not yet handed to the engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: Optional[BaseException] = None
        self.listener: Optional[OutputListener] = None
        # called once, on the engine thread, if it stops (e.g. serve exits so a supervisor
        # restarts it)
        self.on_fatal: Optional[Callable[[BaseException], None]] = None
        self._closing: Optional[str] = None  # why new requests are refused (close())
        self._watchdog: Optional[StepWatchdog] = None
        if engine.engine_core.deadlines.enabled:
            self._watchdog = StepWatchdog(lambda reason: self._fail_all(EngineHungError(reason)))
            engine.engine_core.watch = self._watchdog
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def warm_up_grammars(self, delay: float = WARM_UP_DELAY_S,
                         busy: Callable[[], bool] = lambda: False) -> None:
        """Build the grammar engine's view of the vocabulary (~1.3 s for Qwen2's, holding the
        GIL) on a side thread once the engine has been idle, and `busy()` (e.g. the server's
        tokenizing) false, for `delay` seconds: neither start-up nor a request in flight waits
        for it. A constrained request that comes first builds it itself."""
        threading.Thread(target=self._warm_up_when_idle, args=(delay, busy),
                         name="pagedllm-grammar-warm-up", daemon=True).start()

    def _warm_up_when_idle(self, delay: float, busy: Callable[[], bool]) -> None:
        grammars = self.engine.input_processor.grammars
        idle_since = time.monotonic()
        while not self._stop and not grammars.warm:
            if self._pending or self.engine.has_unfinished_requests() or busy():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= delay:
                grammars.warm_up()
                return
            time.sleep(0.05)

    @property
    def tokenizer(self):
        """The engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """Size of the model's vocabulary: valid token ids are [0, vocab_size)."""
        return self.engine.vocab_size

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults."""
        return self.engine.default_sampling_params()

    def chat_prompt_ids(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of a conversation through the chat template (ValueError naming messages)."""
        return self.engine.input_processor.chat_prompt_ids(messages, **options)

    def stats(self) -> EngineStats:
        """Running and waiting sequences and KV-cache usage, read now."""
        running, waiting = self.engine.lora_names()
        return EngineStats(self.engine.num_running, self.engine.num_waiting,
                           self.engine.kv_cache_usage, running, waiting,
                           self.engine.spec_stats())

    async def compile_grammar(self, params: SamplingParams) -> Optional[CompiledGrammar]:
        """The request's constraint compiled on a grammar worker while the event loop goes on
        (None without one); ValueError naming the field, CompileBusyError. Pass it to
        add_request."""
        if params.structured_outputs is None:
            return None
        return await self.engine.input_processor.grammars.compile_async(params.structured_outputs)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    max_tokens_must_fit: bool = False,
                    on_close: Optional[Callable[[], None]] = None,
                    grammar: Optional[CompiledGrammar] = None,
                    lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """Validate and queue now (ValueError, EngineOverloadedError); return the output stream.

        Iterate the stream to the end or close it: closing it early aborts the request. The
        stream raises RequestFailedError if this request fails on its own (StreamBackloggedError
        if it was left untaken), EngineDeadError if the engine stops. max_tokens_must_fit:
        refuse a max_tokens the context cannot hold (the server's rule) instead of capping it.
        on_close: called once, on the event loop, when the stream ends, closes or is aborted.
        grammar: from compile_grammar (without it a constrained request waits here for its
        compile). lora_request: the LoRA adapter it runs with (enable_lora).
        """
        stream = self._admit(request_id, on_close, lambda: self.engine.input_processor.process(
            request_id, prompt, params, max_tokens_must_fit=max_tokens_must_fit,
            grammar=grammar, lora_request=self.engine.adapters.check(lora_request)))
        delta = params.output_kind == RequestOutputKind.DELTA
        return self._outputs(request_id, stream, time.monotonic(), delta)

    async def encode(self, prompt: PromptType, params: Optional[PoolingParams],
                     request_id: str) -> PoolingRequestOutput:
        """Pool one prompt (a pooling model only): validated and queued now (ValueError,
        EngineOverloadedError), its result awaited; cancelling the wait aborts it."""
        stream = self._admit(request_id, None, lambda: self.engine.input_processor.
                             process_pooling(request_id, prompt, params))
        finished = False
        try:
            item = await stream.queue.get()
            finished = True
            if isinstance(item, RequestFailedError):
                raise item
            if isinstance(item, EngineClosingError):
                finished = False  # cut by the drain: the finally aborts it
                raise item
            if isinstance(item, BaseException):
                raise EngineDeadError(f"the engine stopped: {item!r}")
            if item.error is not None:
                raise RequestFailedError(f"request {request_id} failed: {item.error}")
            return item
        finally:
            self._forget(request_id)
            if not finished:
                self.abort(request_id)

    def _admit(self, request_id: str, on_close: Optional[Callable[[], None]],
               process: Callable[[], Any]) -> _Stream:
        """Check the engine takes requests and has room, run process() (the input
        processor's validation), and queue its result; the request's stream."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if self._closing is not None:
            raise EngineClosingError(self._closing)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        with self._lock:
            if self.engine.num_waiting + self._pending >= self.max_waiting:
                raise EngineOverloadedError(
                    f"server busy: {self.max_waiting} requests are already waiting; retry later")
            self._pending += 1
        try:
            processed = process()
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), on_close)
        self._streams[request_id] = stream
        self._submit(lambda: self._add(request_id, processed))
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (add_request + iterate)."""
        async for out in self.add_request(request_id, prompt, params):
            yield out

    async def _outputs(self, request_id: str, stream: _Stream, started: float,
                       delta: bool) -> AsyncIterator[RequestOutput]:
        finished = False
        last, tokens = started, 0
        try:
            while not finished:
                item = await stream.queue.get()
                stream.idle_since = stream.loop.time()
                if isinstance(item, RequestFailedError):
                    finished = True  # the engine has forgotten it already
                    raise item
                if isinstance(item, EngineClosingError):
                    raise item  # cut by the drain: the finally aborts it
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}")
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(f"request {request_id} failed: {item.error}")
                finished = item.finished
                last, tokens = self._observe(item, started, last, tokens, delta)
                yield item
        finally:
            self._forget(request_id)
            if not finished:  # the caller went away (client disconnect): free its blocks now
                self.abort(request_id)

    def _observe(self, out: RequestOutput, started: float, last: float, tokens: int,
                 delta: bool) -> tuple[float, int]:
        """Report timing to the listener; returns (time of this output, tokens so far)."""
        now, total = time.monotonic(), sum(len(c.token_ids) for c in out.outputs)
        if delta:  # the output holds only the new tokens
            total += tokens
        if self.listener is not None and total > tokens:
            if tokens == 0:
                self.listener.first_token(len(out.prompt_token_ids), total, now - last)
            else:
                self.listener.next_tokens(total - tokens, now - last)
        if self.listener is not None and out.finished:
            self.listener.finished(out.request_id, len(out.prompt_token_ids), total,
                                   now - started)
        return (now, total) if total > tokens else (last, tokens)

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks return to the pool on the engine thread's next turn."""
        self._forget(request_id)
        self._submit(lambda: self.engine.abort_request([request_id]))

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.on_close is not None:
            stream.on_close()

    def _queue_output(self, request_id: str, stream: _Stream, out: RequestOutput) -> None:
        """On the stream's loop: queue out, or abort a request whose caller has left
        max_stream_backlog outputs untaken and taken nothing for BACKLOG_GRACE_S (its last
        output is always queued: the engine has freed its blocks already)."""
        if self._streams.get(request_id) is not stream:  # closed or aborted meanwhile
            return
        now = stream.loop.time()
        if stream.queue.empty():
            stream.idle_since = now
        if (out.finished or stream.queue.qsize() < self.max_stream_backlog
                or now - stream.idle_since < BACKLOG_GRACE_S):
            stream.queue.put_nowait(out)
            return
        logger.warning("request %s: aborted: its client has not taken its last %d outputs "
                       "(--max-stream-backlog %d); its KV blocks are freed", request_id,
                       stream.queue.qsize(), self.max_stream_backlog)
        self.abort(request_id)
        while not stream.queue.empty():  # the backlog's memory goes at once
            stream.queue.get_nowait()
        stream.queue.put_nowait(StreamBackloggedError(
            f"request {request_id} was aborted: its client did not take its output (more than "
            f"{self.max_stream_backlog} outputs waited; --max-stream-backlog)"))

    @property
    def num_streams(self) -> int:
        """Requests whose outputs a caller still reads."""
        return len(self._streams)

    @property
    def closing(self) -> Optional[str]:
        """Why new requests are refused (close()), or None."""
        return self._closing

    def close(self, reason: str) -> None:
        """Refuse new requests from now on (EngineClosingError with `reason`); the open
        streams go on."""
        self._closing = reason

    def fail_streams(self, reason: str) -> int:
        """End every open stream with EngineClosingError(reason) (its request is aborted);
        how many there were."""
        return self._put_all(EngineClosingError(reason))

    def _put_all(self, item: BaseException) -> int:
        """Queue item on every open stream (from any thread); how many there were."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        return len(streams)

    def shutdown(self) -> None:
        """Stop the engine thread."""
        self._stop = True
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.stop()
        if isinstance(self.error, EngineHungError):
            # the engine thread waits on a step that will not come: stop the ranks first (the
            # wait then fails) and do not wait long for the thread
            self.engine.shutdown()
            self._thread.join(timeout=1)
            return
        self._thread.join(timeout=10)
        self.engine.shutdown()  # worker processes, with several ranks

    # ---- engine thread ------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _add(self, request_id: str, processed) -> None:
        with self._lock:
            self._pending -= 1
        if request_id not in self._streams:  # aborted while queued
            return
        try:
            self.engine.add_processed(request_id, processed)
        except Exception as err:  # this request alone fails; the engine goes on
            logger.exception("request %s: queueing it failed", request_id)
            self.engine.abort_request([request_id])
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RequestFailedError(
                    f"request {request_id} failed: {type(err).__name__}: {err}"))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(self._queue_output, out.request_id, stream, out)

    def _run(self) -> None:
        try:
            while not self._stop:
                while True:
                    try:
                        self._inbox.get_nowait()()
                    except queue.Empty:
                        break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
                else:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as err:  # fail every open stream instead of hanging it
            logger.exception("engine thread stopped")
            self._fail_all(err)

    def _fail_all(self, err: BaseException) -> None:
        """The engine cannot go on (engine thread or watchdog): record why, fail every open
        stream, call on_fatal; only the first failure counts."""
        with self._lock:
            if self.error is not None:
                return
            self.error = err
        self._stop = True  # a hung step that returns after all runs no further step
        self._put_all(err)
        if self.on_fatal is not None:
            self.on_fatal(err)
