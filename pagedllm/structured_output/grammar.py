"""Grammars for structured outputs, compiled once per spec and matched per request.

The backend is llguidance (vLLM's "guidance" backend), not xgrammar (vLLM's default): on Linux
x86-64 the xgrammar wheel requires triton, which adds ~1 GB to a CPU-only install (the whole
venv is ~1.2 GB without it), while llguidance is one 3 MB wheel with no dependencies. Its mask
over Qwen2's 152k-token vocabulary takes ~0.1 ms per request and step here.

    request constraint --compile (caller's thread, cached by spec)--> CompiledGrammar
    CompiledGrammar --new_state()--> GrammarState (one per sequence; lives on the Request)
    each step: GrammarState.fill_bitmask -> sampler masks logits -> GrammarState.accept(token)
"""
from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import llguidance
import torch
from llguidance import LLMatcher

from pagedllm.sampling_params import StructuredOutputsParams

CACHE_SIZE = 128  # compiled grammars kept, least recently used dropped first


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into bitmask[row] (int32 words on the CPU).

        What llguidance.torch.fill_next_token_bitmask does, without importing that module: it
        pulls in torch's compiler (torch._dynamo), ~1.9 s of every start-up."""
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
            raise ValueError("the grammar bitmask must be contiguous int32 rows on the CPU")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing (but end-of-sequence) may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> Optional[str]:
        """Why the matcher stopped accepting, if it did."""
        return self._matcher.get_error() if self._matcher.is_error() else None


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar and a matcher to copy for each sequence."""

    spec: str  # llguidance's grammar text
    _prototype: LLMatcher

    def new_state(self) -> GrammarState:
        """A fresh state at the grammar's start."""
        return GrammarState(self._prototype.deep_copy())


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that does not set it."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _json_grammar(schema: dict, params: StructuredOutputsParams) -> str:
    """JSON-schema grammar with the request's whitespace and closed-object options."""
    if params.disable_additional_properties:
        schema = _closed(schema)
    overrides: dict[str, Any] = {}
    if params.disable_any_whitespace:  # compact JSON: no whitespace between tokens
        overrides["whitespace_flexible"] = False
    if params.whitespace_pattern is not None:
        overrides["whitespace_pattern"] = params.whitespace_pattern
    return LLMatcher.grammar_from_json_schema(schema, overrides=overrides or None)


def _grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint (ValueError naming the field if malformed)."""
    kind, value = params.kind, getattr(params, params.kind)
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return _json_grammar(schema, params)
        if kind == "json_object":
            return _json_grammar({"type": "object"}, params)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(value)))
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{params.label} is not a valid {kind}: {err}") from None


def tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer's Rust backend as JSON, without padding or truncation: what llguidance
    builds its vocabulary view from (llguidance.hf does the same, but takes only a
    transformers tokenizer, and imports transformers)."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarCompiler:
    """Compiles constraints against one tokenizer; a bounded LRU cache keyed by the spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self._hf_tokenizer, self._vocab_size = tokenizer, vocab_size
        self._ll_tokenizer: Optional[llguidance.LLTokenizer] = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the server compiles on its handlers' threads

    @property
    def warm(self) -> bool:
        """Whether the vocabulary view is built."""
        return self._ll_tokenizer is not None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # built on first use (~1.3 s for a 152k vocabulary), not at start-up
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                tokenizer_json(self._hf_tokenizer), n_vocab=self._vocab_size,
                eos_token=self._hf_tokenizer.eos_token_id)
        return self._ll_tokenizer

    def warm_up(self) -> None:
        """Build the grammar engine's vocabulary view now (a server does, on a side thread, so
        that its first constrained request does not wait ~1.3 s for it)."""
        with self._lock:
            self._tokenizer()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a constraint; ValueError naming the field if it is invalid."""
        spec = _grammar_text(params)
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            tokenizer = self._tokenizer()
            error = LLMatcher.validate_grammar(spec, tokenizer)
            if error:
                raise ValueError(f"{params.label} is not a valid {params.kind}: {error.strip()}")
            compiled = CompiledGrammar(spec, LLMatcher(tokenizer, spec))
            self._cache[spec] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    @property
    def cache_len(self) -> int:
        """Grammars held in the cache."""
        return len(self._cache)
