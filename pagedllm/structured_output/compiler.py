"""GrammarCompiler: a request's constraint -> CompiledGrammar, safely.

    constraint --spec_key (hash; byte and choice caps)--> cache hit: done
               --check_spec (rules, schema nodes)--> CompilePool worker (large stack):
                   grammar text -> LLMatcher -> first mask   (within grammar_compile_timeout)
               --> cache (LRU, bounded in entries and in estimated bytes)

compile() waits on the caller's thread (the offline LLM); compile_async() awaits it (the
server's handlers), so neither the event loop nor the engine thread ever compiles.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, TimeoutError as FutureTimeout
from typing import Any, Optional

import llguidance
from llguidance import LLMatcher, LLParserLimits

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.bitmask import allocate_bitmask
from pagedllm.structured_output.compile_pool import CompileBusyError, CompilePool
from pagedllm.structured_output.grammar import (PARSER_LIMITS, CompiledGrammar, grammar_text,
                                                tokenizer_json)
from pagedllm.structured_output.spec_caps import SpecKey, check_spec, spec_key
from pagedllm.structured_output.spelling import check_spellable, spellable_bytes

CACHE_SIZE = 128  # compiled grammars kept, least recently used dropped first
# a compiled grammar's memory, fitted to the RSS growth of compiles of known sizes (choice,
# JSON-schema properties, Lark alternatives; 1k-250k bytes of grammar text): 110-190 bytes per
# byte of llguidance's grammar text, ~0.2-1 MB for a small one (docs/structured_outputs.md)
ENTRY_BASE_BYTES = 256 * 1024
BYTES_PER_GRAMMAR_BYTE = 200
# the first compile builds the vocabulary view first (~1.3 s for 152k tokens, longer on a busy
# machine): not the request's doing, so not counted against its time limit
COLD_START_ALLOWANCE_S = 30.0


def estimated_bytes(spec: str) -> int:
    """The memory a compiled grammar holds, estimated from its grammar text."""
    return ENTRY_BASE_BYTES + BYTES_PER_GRAMMAR_BYTE * len(spec)


class GrammarCompiler:
    """Compiles constraints against one tokenizer on large-stack workers, within the limits."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 config: Optional[StructuredOutputsConfig] = None,
                 cache_size: int = CACHE_SIZE) -> None:
        self._hf_tokenizer, self._vocab_size = tokenizer, vocab_size
        self.config = config or StructuredOutputsConfig()
        self._ll_tokenizer: Optional[llguidance.LLTokenizer] = None
        self._spellable: frozenset[int] = frozenset(range(256))  # with _ll_tokenizer
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size, self._cache_bytes = cache_size, 0
        self._in_flight: dict[str, Future] = {}  # one compile per spec, however many ask
        self._lock = threading.Lock()  # the cache and _in_flight
        self._tokenizer_lock = threading.Lock()
        self._pool = CompilePool()

    @property
    def warm(self) -> bool:
        """Whether the vocabulary view is built."""
        return self._ll_tokenizer is not None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # built on first use (~1.3 s for a 152k vocabulary), not at start-up
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tokenizer_json(self._hf_tokenizer), n_vocab=self._vocab_size,
                    eos_token=self._hf_tokenizer.eos_token_id)
                self._spellable = spellable_bytes(self._ll_tokenizer)
            return self._ll_tokenizer

    def warm_up(self) -> None:
        """Build the grammar engine's vocabulary view now (a server does, on a side thread, so
        that its first constrained request does not wait ~1.3 s for it)."""
        self._tokenizer()

    def submit(self, params: StructuredOutputsParams) -> "Future[CompiledGrammar]":
        """The compile of a constraint, started (or the cached grammar, done). ValueError
        naming the field for a spec over a cap; CompileBusyError if the workers are full."""
        key = spec_key(params, self.config)
        with self._lock:
            hit = self._cache.get(key.digest)
            if hit is not None:
                self._cache.move_to_end(key.digest)
                done: Future = Future()
                done.set_result(hit)
                return done
            running = self._in_flight.get(key.digest)
            if running is not None:
                return running
        check_spec(params, self.config)
        with self._lock:
            future = self._in_flight.get(key.digest) or self._pool.submit(
                lambda: self._build(params))
            self._in_flight[key.digest] = future
        future.add_done_callback(lambda f: self._finished(key, f))
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar, waited for here; ValueError naming the field if it is invalid
        or not compiled within grammar_compile_timeout; CompileBusyError."""
        wait_s = self._wait_s()
        future = self.submit(params)
        try:
            return future.result(timeout=wait_s)
        except FutureTimeout:
            raise self._late(future, params) from None
        except CancelledError:
            raise _busy() from None

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """compile() for a coroutine: the event loop goes on while a worker compiles."""
        wait_s = self._wait_s()
        future = self.submit(params)
        waiter = asyncio.wrap_future(future)
        await asyncio.wait([waiter], timeout=wait_s)
        if not waiter.done():
            # its outcome, when it comes, is nobody's: retrieve it so asyncio does not log it
            waiter.add_done_callback(lambda w: w.cancelled() or w.exception())
            raise self._late(future, params)
        if waiter.cancelled():
            raise _busy()
        return waiter.result()

    def _wait_s(self) -> float:
        """How long a caller waits for its compile (the worker itself enforces the limit)."""
        cold = 0.0 if self.warm else COLD_START_ALLOWANCE_S
        return self.config.grammar_compile_timeout + cold

    def _late(self, future: Future, params: StructuredOutputsParams) -> Exception:
        if future.cancel():  # still queued behind other compiles: the server is busy
            return _busy()
        return _timeout_error(params, self.config.grammar_compile_timeout)

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """On a worker: grammar text, matcher, first mask (the admission check's and the first
        step's), all within the time limit."""
        tokenizer = self._tokenizer()
        started = time.monotonic()
        spec = grammar_text(params)
        check_spellable(params, self._spellable)
        # log_level 0: its errors reach the request's error (and pagedllm's log) instead
        matcher = LLMatcher(tokenizer, spec, log_level=0, limits=LLParserLimits(**PARSER_LIMITS))
        first_mask = allocate_bitmask(1, self._vocab_size)[0]
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(first_mask.data_ptr(), first_mask.numel() * 4)
        if matcher.is_error():
            raise ValueError(f"{params.label} is not a valid {params.kind}: "
                             f"{matcher.get_error().strip()}")
        if time.monotonic() - started > self.config.grammar_compile_timeout:
            raise _timeout_error(params, self.config.grammar_compile_timeout)
        return CompiledGrammar(spec, matcher, first_mask, self.config.max_grammar_mask_ms / 1e3,
                               estimated_bytes(spec))

    def _finished(self, key: SpecKey, future: Future) -> None:
        with self._lock:
            self._in_flight.pop(key.digest, None)
            if future.cancelled() or future.exception() is not None:
                return
            self._insert(key.digest, future.result())

    def _insert(self, digest: str, grammar: CompiledGrammar) -> None:
        """Cache it, dropping the least recently used until both bounds hold (one bigger than
        the whole byte bound is not kept)."""
        if grammar.num_bytes > self.config.grammar_cache_bytes or digest in self._cache:
            return
        self._cache[digest] = grammar
        self._cache_bytes += grammar.num_bytes
        while (len(self._cache) > self._cache_size
               or self._cache_bytes > self.config.grammar_cache_bytes):
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.num_bytes

    @property
    def cache_len(self) -> int:
        """Grammars held in the cache."""
        return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        """Estimated bytes of the grammars held in the cache."""
        return self._cache_bytes


def _busy() -> CompileBusyError:
    return CompileBusyError("the grammar compiler is busy: every worker is compiling another "
                            "constraint; retry later")


def _timeout_error(params: StructuredOutputsParams, timeout: float) -> ValueError:
    return ValueError(f"{params.label} did not compile within {timeout:g} s "
                      "(grammar_compile_timeout, --grammar-compile-timeout): send a simpler "
                      "constraint, or start the engine with a longer limit")
