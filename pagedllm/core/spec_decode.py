"""Speculative decoding on the scheduler's side: what to propose for a request, and how many.

A proposer gives up to k draft tokens that would follow a request's tokens; the scheduler sends
them with the request's last token, the runner computes all k + 1 positions in one forward pass
and samples each from the target model, and the drafts are kept up to the first that differs
from the target's own draw (sample/rejection.py). The n-gram proposer needs no model: it looks
the sequence's last n tokens up in the request's own text (its prediction, then its prompt and
output) and proposes what followed them there. A draft model would implement the same
`Proposer` interface.

    tokens     ... a b c d | e                    (d: last n = 2 tokens "c d" seen before at i)
    earlier    ... c d x y z ...                  -> drafts x y z
    verify     positions of d x y z, one pass     -> target samples t0 t1 t2 t3
    kept       x if t0 == x, then y if t1 == y ... and the first t that differs (or t3)

Each request starts with a cheap probe (one draft at the default cost); after each verify its
k is the one that gives the most tokens per second for its own acceptance and what a verify row costs here
(core/spec_cost.py, fitted on the engine's steps). A request for which no k pays, or whose
acceptance falls under min_acceptance_rate, stops proposing for PAUSE_TOKENS tokens (twice as
long after each pause in a row, up to 16 times), since a verify pass that keeps nothing costs
more than the plain decode step it replaces; then it tries a cheap draft again. Where even an
always-kept draft could not pay (a draft model as large as the target), nothing is proposed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.spec_cost import (DECAY, DEFAULT_ROW_COST, PRIOR_KEPT, PRIOR_MISSED,
                                     StepCost, best_draft_length)

logger = logging.getLogger("pagedllm")

PAUSE_TOKENS = 32  # output tokens a request with a low acceptance rate decodes plainly
MAX_PAUSE_DOUBLINGS = 4  # each pause in a row twice the one before: 32, 64, ... 512 tokens


class Proposer(Protocol):
    """Proposes draft tokens that would follow a request's tokens."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """At most max_tokens (>= 1) draft ids; [] when there is nothing to propose."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's method "ngram"): the longest n-gram (prompt_lookup_max >= n >=
    prompt_lookup_min) ending the sequence that occurred before, in the request's prediction
    first, then in its prompt and output (earliest occurrence); the tokens after it."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to max_tokens ids following the matched n-gram."""
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        sources = [tokens]
        if request.prediction_token_ids:
            sources.insert(0, np.asarray(request.prediction_token_ids, dtype=np.int64))
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for source, is_context in ((s, s is tokens) for s in sources):
                found = ngram_continuation(source, suffix, max_tokens, is_context)
                if found:
                    return found
        return []


def ngram_continuation(source: np.ndarray, suffix: np.ndarray, max_tokens: int,
                       is_context: bool) -> list[int]:
    """The tokens after the earliest occurrence of `suffix` in `source` that has at least one
    token after it ([] if none); in the sequence's own tokens (is_context) the suffix itself
    does not count."""
    n = suffix.shape[0]
    body = source[:-1] if is_context else source  # an occurrence needs a token after it
    if body.shape[0] < n or (not is_context and source.shape[0] <= n):
        return []
    windows = sliding_window_view(body, n)  # [L - n + 1, n]
    starts = np.flatnonzero((windows == suffix).all(axis=1))
    for start in starts.tolist():
        after = source[start + n:start + n + max_tokens]
        if after.shape[0]:
            return after.tolist()
    return []


class RunnerDraftProposer:
    """A draft model's proposals (method "draft_model"): the model runner drafted them after
    the request's previous step (worker/draft_runner.py); they continue its tokens."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """The runner's drafts for this request, at most max_tokens."""
        return request.draft_token_ids[:max_tokens]


@dataclass
class SpecRequestState:
    """One request's speculation: its current draft length and recent acceptance (drafts
    kept, and verifies that refused one, decayed per verify: a draft's chance to be kept)."""

    num_tokens: int  # drafts to ask for next time
    kept: float = PRIOR_KEPT
    missed: float = PRIOR_MISSED
    paused_until: int = 0  # output length from which it proposes again
    pauses: int = 0  # pauses since its drafts were last all kept

    @property
    def acceptance(self) -> float:
        """The chance that a draft is kept, given the ones before it were."""
        return self.kept / (self.kept + self.missed)


@dataclass
class SpecStats:
    """Counts since start, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0  # verify steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # kept drafts at each position

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted over proposed tokens (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    def copy(self) -> "SpecStats":
        """A snapshot (the engine's counts go on)."""
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_pos))

    def since(self, earlier: "SpecStats") -> "SpecStats":
        """The counts added after `earlier` (a snapshot of the same counter)."""
        return SpecStats(self.num_drafts - earlier.num_drafts,
                         self.num_draft_tokens - earlier.num_draft_tokens,
                         self.num_accepted_tokens - earlier.num_accepted_tokens,
                         [a - b for a, b in zip(self.accepted_per_pos, earlier.accepted_per_pos)])

    def log_line(self, seconds: float) -> str:
        """vLLM's SpecDecoding metrics line for these counts over `seconds`."""
        drafts = max(1, self.num_drafts)
        per_pos = ", ".join(f"{n / drafts:.3f}" for n in self.accepted_per_pos)
        return (f"SpecDecoding metrics: Mean acceptance length: "
                f"{1 + self.num_accepted_tokens / drafts:.2f}, Accepted throughput: "
                f"{self.num_accepted_tokens / seconds:.2f} tokens/s, Drafted throughput: "
                f"{self.num_draft_tokens / seconds:.2f} tokens/s, Accepted: "
                f"{self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: "
                f"{100 * (self.acceptance_rate or 0.0):.1f}%")


class Speculator:
    """The scheduler's speculation: per-request draft lengths, proposals, acceptance stats."""

    def __init__(self, config: SpeculativeConfig, proposer: Optional[Proposer] = None,
                 draft_cost: float = 0.0) -> None:
        """draft_cost: a draft model's step against the target's (its share of the target's
        parameters), added to a verify row's prior cost."""
        self.config = config
        if proposer is None:
            proposer = RunnerDraftProposer() if config.uses_draft_model else NgramProposer(config)
        self.proposer = proposer
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # what a verify row (and its draft) costs here, from the engine's steps
        self.cost = StepCost(DEFAULT_ROW_COST, draft_cost)
        self._states: dict[str, SpecRequestState] = {}
        self._told_cannot_pay = False

    @property
    def drafts_in_runner(self) -> bool:
        """The drafts come from a draft model in the runner, which the scheduler asks for a
        step ahead (num_to_draft) and gives KV slots for."""
        return self.config.uses_draft_model

    def num_to_draft(self, request: Request) -> int:
        """How many drafts to ask for this request's next step: its current k, or 0 for a
        request speculation cannot serve exactly or one paused for low acceptance."""
        if not eligible(request):
            return 0
        state = self._state(request)
        if request.num_output_tokens < state.paused_until or not self._can_pay(request):
            return 0
        return state.num_tokens

    def _cost(self, request: Request) -> float:
        """A draft's cost against a plain step for this request: the fitted one, or for a
        seeded request the prior (its draws follow its verify rows: its k must not follow
        timing, or its output would not be reproducible)."""
        if request.sampling_params.seed is not None:
            return self.cost.prior_cost
        return self.cost.row_cost

    def _can_pay(self, request: Request) -> bool:
        """Whether a draft could pay here at all: not when one costs as much as the tokens
        even an always-kept draft gives (a draft model as large as the target: its catch-up
        after each pause alone costs more than speculation could give back). Said once."""
        if self.config.min_acceptance_rate == 0:
            return True  # asked never to stop
        cost = self._cost(request)
        if best_draft_length(1.0, cost, self.config.num_speculative_tokens) > 0:
            return True
        if not self._told_cannot_pay:
            self._told_cannot_pay = True
            logger.warning("speculative decoding cannot pay here: a draft costs %.2f of a plain "
                           "step (a verify row and, with a draft model, its step), more than an "
                           "always-kept draft gives back; requests decode plainly", cost)
        return False

    def drafts(self, request: Request, room: int) -> list[int]:
        """Draft tokens for a request about to decode its last token, at most `room` (what
        the budget, max_tokens and max_model_len leave after that token): [] for a request
        speculation cannot serve exactly (see `eligible`) or one paused for low acceptance."""
        k = min(room, self.num_to_draft(request))
        return self.proposer.propose(request, k) if k > 0 else []

    def _state(self, request: Request) -> SpecRequestState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = SpecRequestState(self._first_k())
        return state

    def _first_k(self) -> int:
        """A new request's first draft length: what pays for the prior acceptance (0.5) at the
        prior cost, at least one (a cheap probe that grows as drafts are kept); with
        min_acceptance_rate 0, num_speculative_tokens (vLLM's fixed k)."""
        limit = self.config.num_speculative_tokens
        if self.config.min_acceptance_rate == 0:
            return limit
        prior = PRIOR_KEPT / (PRIOR_KEPT + PRIOR_MISSED)
        return max(1, best_draft_length(prior, self.cost.prior_cost, limit))

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step's result for one request: its acceptance, its next k (or a pause
        when none pays), the stats."""
        stats, state = self.stats, self._states[request.request_id]
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        state.kept = DECAY * state.kept + num_accepted
        state.missed = DECAY * state.missed + (1.0 if num_accepted < num_drafts else 0.0)
        if num_accepted == num_drafts:
            state.pauses = 0  # paying again: a next pause starts short
        limit = self.config.num_speculative_tokens
        if self.config.min_acceptance_rate == 0:  # asked never to stop: vLLM's fixed k
            state.num_tokens = limit
            return
        state.num_tokens = best_draft_length(state.acceptance, self._cost(request), limit)
        if state.num_tokens == 0 or state.acceptance < self.config.min_acceptance_rate:
            state.paused_until = request.num_output_tokens + (
                PAUSE_TOKENS << min(state.pauses, MAX_PAUSE_DOUBLINGS))
            state.pauses += 1
            state.kept, state.missed = PRIOR_KEPT, PRIOR_MISSED  # a fresh try after the pause
            state.num_tokens = self._first_k()

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """The time of a step the runner computed, without its draft model's: a decode-only
        one (each request its last token and its drafts) feeds the fit of what a verify row
        costs."""
        spec = sched.spec_token_ids
        if any(n != 1 + len(spec.get(r, ())) for r, n in sched.num_scheduled_tokens.items()):
            return  # a prompt chunk's rows cost otherwise
        self.cost.observe(sum(sched.num_scheduled_tokens.values()),
                          len(sched.num_scheduled_tokens), seconds)

    def reset_stats(self) -> None:
        """Start counting again (bench: the timed requests only)."""
        self.stats = SpecStats(accepted_per_pos=[0] * self.config.num_speculative_tokens)

    def forget(self, request_id: str) -> None:
        """A finished request's state is dropped."""
        self._states.pop(request_id, None)


def eligible(request: Request) -> bool:
    """Whether the runner verifies this request's drafts exactly: not a pooling request (one
    under a grammar is: its drafts are checked against it, see grammar_allowed)."""
    return request.pooling_params is None


def grammar_allowed(request: Request, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the request's grammar refuses, none after one that
    completes it (all of them for a free request); the grammar's state is unchanged. The
    scheduler then fills a mask row after each kept draft (Scheduler._grammar_bitmask).
    A grammar that raises here gives no drafts: the scheduler goes on."""
    if not drafts or request.grammar is None:
        return drafts
    try:
        return drafts[:request.grammar.check_drafts(drafts)]
    except Exception:  # one request's broken grammar must not stop the scheduler
        return []
