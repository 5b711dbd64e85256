"""Grammars for structured outputs, compiled once per spec and matched per request.

The backend is llguidance (vLLM's "guidance" backend), not xgrammar (vLLM's default): on Linux
x86-64 the xgrammar wheel requires triton, which adds ~1 GB to a CPU-only install (the whole
venv is ~1.2 GB without it), while llguidance is one 3 MB wheel with no dependencies. Its mask
over Qwen2's 152k-token vocabulary takes ~0.1 ms per request and step here.

    request constraint --compile (compiler.py: a large-stack worker, cached)--> CompiledGrammar
    CompiledGrammar --new_state()--> GrammarState (one per sequence; lives on the Request)
    each step: GrammarState.fill_bitmask -> sampler masks logits -> GrammarState.accept(token)
"""
from __future__ import annotations

import copy
import json
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import llguidance
import torch
from llguidance import LLMatcher

from pagedllm.sampling_params import StructuredOutputsParams

# what llguidance may spend: its defaults, spelled out (vLLM's guidance backend uses them too).
# The step limits bound one mask's work inside the Rust code; max_items_in_row is why a choice
# of more than ~2,000 strings, or an object of more than ~500 optional properties, stops at run
# time ("Current row has N items")
# verbose_errors off: llguidance's verbose error carries the parser state and the whole
# grammar (MBs for a large one) into every message and log line
PARSER_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000,
                     step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=250_000,
                     max_grammar_size=500_000, verbose_errors=False)


class MaskTooSlowError(RuntimeError):
    """A request's masks took more than max_grammar_mask_ms of CPU in one step: it is stopped so
    that it does not slow every other request's steps."""


class MaskBudget:
    """The CPU time one request's sequences (its n samples) may spend on masks in one step.

    A step is recognised by its bitmask tensor (one per step; held weakly, so a new step's
    tensor never passes for the old one's). Once over, every later mask of the request fails
    without being computed."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._step: Optional[weakref.ref] = None
        self._spent = 0.0
        self._draft_spent = 0.0  # speculative decoding: the drafts' masks of this step
        self._over: Optional[str] = None

    def check(self) -> None:
        """MaskTooSlowError if the request went over in an earlier step."""
        if self._over is not None:
            raise MaskTooSlowError(self._over)

    def charge(self, bitmask: torch.Tensor, seconds: float) -> None:
        """Count one mask of this step; MaskTooSlowError once the step's total is over."""
        self._enter(bitmask)
        self._spent += seconds
        if self._spent > self.limit_s:
            self._over = (f"the grammar's allowed-token masks took {self._spent * 1e3:.0f} ms of "
                          f"CPU in one step, more than max_grammar_mask_ms="
                          f"{self.limit_s * 1e3:g} (--max-grammar-mask-ms); the request was "
                          "stopped so that it does not slow the others")
            self.check()

    def draft_room(self, bitmask: torch.Tensor) -> bool:
        """Whether one more draft's mask may be computed in this step: the step's masks, the
        drafts' included, are still under the limit. A draft's mask never stops the request
        (speculation must not fail one that plain decoding serves): past the limit, its
        drafts stop."""
        self._enter(bitmask)
        return self._over is None and self._spent + self._draft_spent < self.limit_s

    def charge_draft(self, bitmask: torch.Tensor, seconds: float) -> None:
        """Count one draft's mask of this step (see draft_room)."""
        self._enter(bitmask)
        self._draft_spent += seconds

    def _enter(self, bitmask: torch.Tensor) -> None:
        """Start counting afresh when bitmask is a new step's."""
        if self._step is None or self._step() is not bitmask:
            self._step, self._spent, self._draft_spent = weakref.ref(bitmask), 0.0, 0.0


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: LLMatcher, first_mask: Optional[torch.Tensor] = None,
                 budget: Optional[MaskBudget] = None) -> None:
        self._matcher = matcher
        self._first_mask = first_mask  # the mask at the start, computed when compiled
        self._budget = budget or MaskBudget(math.inf)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into bitmask[row] (int32 words on the CPU);
        MaskTooSlowError once the request's masks are over its CPU budget for a step.

        What llguidance.torch.fill_next_token_bitmask does, without importing that module: it
        pulls in torch's compiler (torch._dynamo), ~1.9 s of every start-up."""
        words = self._row(bitmask, row)
        if self._first_mask is not None:  # the first step: the compile worker's mask
            words.copy_(self._first_mask)
            return
        self._budget.check()
        self._budget.charge(bitmask, self._compute_mask(words))

    def check_drafts(self, drafts: list[int], bitmask: Optional[torch.Tensor] = None,
                     row: int = 0) -> int:
        """Speculative decoding: how many of drafts (the tokens proposed to follow this state)
        the grammar allows, in order: up to the first it refuses, and none after one that
        completes it (only end-of-sequence may follow that one). With a bitmask, also write
        into bitmask[row + j] the ids allowed after drafts[:j] (bitmask[row] is fill_bitmask's)
        for each draft kept, as long as the mask budget leaves room this step (past it the
        drafts stop, not the request). The state is unchanged after: the matcher goes through
        the drafts and is rolled back, so accept stays the one thing that advances it.

            drafts        d1   d2   d3   d4        (d3 refused)
            rows    row   +1   +2                  (mask after d1; after d1 d2) -> returns 2
        """
        matcher = self._matcher
        if not drafts or matcher.is_stopped():  # stopped: complete, or in error
            return 0
        allowed = matcher.validate_tokens(drafts)  # refused tokens would put it in error
        kept = 0
        try:
            for token in drafts[:allowed]:
                if bitmask is not None and not self._budget.draft_room(bitmask):
                    break
                if not matcher.consume_token(token):  # not after validate_tokens; if it did,
                    break  # the matcher's error fails the request at its update
                kept += 1
                if bitmask is not None:
                    words = self._row(bitmask, row + kept)
                    self._budget.charge_draft(bitmask, self._compute_mask(words))
                if matcher.is_stopped():
                    break
        finally:
            matcher.rollback(kept)
        return kept

    def _compute_mask(self, words: torch.Tensor) -> float:
        """Write the matcher's allowed ids into words; the CPU seconds it took (a busy
        machine's waits are not the grammar's)."""
        started = time.thread_time()
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return time.thread_time() - started

    @staticmethod
    def _row(bitmask: torch.Tensor, row: int) -> torch.Tensor:
        """bitmask[row], checked to be contiguous int32 words on the CPU (the matcher writes
        them through a pointer)."""
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
            raise ValueError("the grammar bitmask must be contiguous int32 rows on the CPU")
        return words

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it."""
        self._first_mask = None
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
    """A validated grammar, a matcher to copy for each sequence, and its first mask."""

    spec: str  # llguidance's grammar text
    _prototype: LLMatcher
    first_mask: torch.Tensor  # [ceil(V / 32)] int32: the ids allowed at the start
    max_mask_s: float = math.inf  # CPU seconds one request's masks may take in a step
    num_bytes: int = 0  # estimated memory held (for the cache's byte bound)

    def new_budget(self) -> MaskBudget:
        """The mask budget one request's sequences share."""
        return MaskBudget(self.max_mask_s)

    def new_state(self, budget: Optional[MaskBudget] = None) -> GrammarState:
        """A fresh state at the grammar's start, charging its masks to budget."""
        return GrammarState(self._prototype.deep_copy(), self.first_mask,
                            budget or self.new_budget())

    def allows_any(self, token_ids: Iterable[int]) -> bool:
        """Whether any of token_ids may come first."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < 32 * self.first_mask.numel())]
        return bool(((self.first_mask[ids // 32] >> (ids % 32).int()) & 1).any())


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


def grammar_text(params: StructuredOutputsParams) -> str:
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
