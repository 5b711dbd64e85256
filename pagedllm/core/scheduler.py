"""Continuous batching over a token budget.

There is no prefill phase and no decode phase: each request has num_computed_tokens catching up
with num_tokens, and every step gives each running request (then waiting ones) as many tokens
as the budget allows. A long prompt is therefore prefilled in chunks, and new requests join a
running batch at any step. When blocks run out, the most recently admitted running request is
preempted: its blocks are freed and it is recomputed from scratch later.

With pipeline parallelism several steps are in flight at once (EngineCore's batch queue): a
request scheduled in a step stays "in flight" until that step's update, and until then it is
not scheduled again (not even its next prompt chunk) nor chosen for preemption, so its sampled
token is never lost and its state on the runner never runs ahead. Aborting or finishing a
request in flight frees its blocks at once: every rank runs the steps in the order they were
scheduled, so a later step that reuses the blocks writes them after the in-flight step has;
the in-flight step's output for it is dropped when it comes.

A pooling request is prefill-only. An encoder's is scheduled only when its whole prompt fits the
step's budget (bidirectional attention needs every token at once); a decoder's (last-token
pooling, config.chunked_pooling) is read in chunks like any prompt. It never hits the prefix
cache, and finishes in the update of the step that reads its last token, with its pooled
vector, its blocks freed; many short ones pack into one step.

With a speculator (speculative_config), a decoding request's step also carries draft tokens
(core/spec_decode.py): they count in the budget and get KV slots, and at the update the
computed count keeps only the drafts the runner kept (docs/speculative_decoding.md). A
constrained request's drafts are cut at the first its grammar refuses, and its bitmask has a row
after each kept draft besides the one after its last token.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Iterable, Optional

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import (CachedRequestData, GrammarBitmask, NewRequestData,
                                        SchedulerOutput)
from pagedllm.core.spec_decode import Speculator, grammar_allowed
from pagedllm.structured_output.bitmask import allocate_bitmask

logger = logging.getLogger("pagedllm")


class Scheduler:
    """Decides, step by step, which requests compute how many tokens."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 vocab_size: int = 0, speculator: Optional[Speculator] = None) -> None:
        """speculator: proposes draft tokens for decoding requests (None: no speculation)."""
        self.config = config
        self.speculator = speculator
        self.vocab_size = vocab_size  # width of the grammar bitmask
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # the requests the runner holds, and how many of each one's token ids it has
        self._runner_tokens: dict[str, int] = {}
        self._in_flight: dict[str, Request] = {}  # scheduled in a step not updated yet
        self._finished_ids: set[str] = set()  # to tell the runner next step
        self._errors: dict[str, str] = {}  # request id -> why it fails at this step's update
        self.num_preemptions = 0  # total since start, for stats and tests

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests early (client gone, stop string seen) and free their blocks."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Anything left to do."""
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running (preempted ones included)."""
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------
    def schedule(self, num_micro_batches: int = 1) -> SchedulerOutput:
        """Pick this step's work: running requests first, then waiting ones while room remains.

        num_micro_batches > 1 (pipeline stages with that many batches in flight): the batch
        takes at most its share of the requests that may run, so that every stage gets one;
        an empty one (not run) leaves the finished ids for the next."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self._micro_batch_seqs(num_micro_batches)
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_token_ids: dict[str, list[int]] = {}
        draft_lengths: dict[str, int] = {}  # a draft model's drafts after this step
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < max_seqs:
            request = self.running[i]
            if request.request_id in self._in_flight:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            old_num_blocks = len(self.kv.block_ids(request.request_id))
            samples = request.num_computed_tokens + num_new == request.num_tokens
            drafts = self._drafts(request, num_new, budget)
            if drafts:
                num_new += len(drafts)
                spec_token_ids[request.request_id] = drafts
            ahead = self._lookahead(request, num_new) if samples else 0
            while not self.kv.allocate_slots(request, num_new + ahead):
                victim = self._preemption_victim()
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    spec_token_ids.pop(request.request_id, None)
                    break
            else:
                if ahead or (not samples and self._mirrors_prompt(request)):
                    draft_lengths[request.request_id] = ahead
                num_scheduled[request.request_id] = num_new
                budget -= num_new
                new_ids = self.kv.block_ids(request.request_id)[old_num_blocks:]
                cached_reqs.append(CachedRequestData(request.request_id, new_ids,
                                                     request.num_computed_tokens,
                                                     self._unsent_tokens(request)))
                i += 1

        loras = {r.lora_int_id for r in self.running} - {None}
        skipped: list[Request] = []  # waiting for an adapter slot; they keep their place
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs
               and len(num_scheduled) < max_seqs):
            request = self.waiting[0]
            if request.request_id in self._in_flight:
                break  # an id reused while the aborted request of that id is still in flight
            if not self._lora_fits(request, loras):
                skipped.append(self.waiting.popleft())
                continue
            hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            if (request.pooling_params is not None and num_new < request.num_tokens
                    and not self.config.chunked_pooling):
                break  # an encoder sees a whole sequence at once: it waits for room
            ahead = 0
            samples = hit.num_tokens + num_new == request.num_tokens
            if samples:  # drafts after it?
                ahead = self._lookahead(request, num_new, hit.num_tokens)
            if ahead and self.kv.allocate_slots(request, num_new + ahead, hit.blocks):
                draft_lengths[request.request_id] = ahead
            elif not self.kv.allocate_slots(request, num_new, hit.blocks):
                break
            elif not samples and self._mirrors_prompt(request):
                draft_lengths[request.request_id] = 0
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = hit.num_tokens
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(NewRequestData(
                request.request_id, request.all_token_ids, request.num_prompt_tokens,
                request.sampling_params, self.kv.block_ids(request.request_id),
                request.num_computed_tokens, request.pooling_params, request.lora_request))
            self._runner_tokens[request.request_id] = request.num_tokens
            loras.add(request.lora_int_id)
            loras.discard(None)
        self.waiting.extendleft(reversed(skipped))

        for req_id in num_scheduled:
            self._in_flight[req_id] = self.requests[req_id]
        if not num_scheduled and num_micro_batches > 1:
            finished = set()  # an empty micro-batch is not run: the next one tells the runner
        else:
            finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled, finished,
                               self._grammar_bitmask(num_scheduled, spec_token_ids),
                               spec_token_ids, draft_lengths)

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Draft tokens to verify with a decoding request's last token: they count in the
        budget and need KV slots (none when the blocks they need are not free: speculation
        never preempts), and leave room for the token sampled after them (max_tokens)."""
        if self.speculator is None or num_new != 1:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        drafts = grammar_allowed(request, self.speculator.drafts(request, room))
        if drafts and not self.kv.can_allocate(request, 1 + len(drafts)):
            return []
        return drafts

    def _lookahead(self, request: Request, num_new: int, computed: Optional[int] = None) -> int:
        """With a draft model, the drafts the runner proposes after this step for a request
        that samples in it: their keys need slots past the step's num_new tokens, which are
        reserved now (0 where they are not free: speculation never preempts), and they must
        leave room for the sampled tokens (max_tokens, max_model_len). computed: a new
        request's cache hit (a running one's computed count by default)."""
        speculator = self.speculator
        if speculator is None or not speculator.drafts_in_runner:
            return 0
        computed = request.num_computed_tokens if computed is None else computed
        k = min(speculator.num_to_draft(request),
                request.max_tokens - request.num_output_tokens - 2,
                self.config.max_model_len - computed - num_new - 1)
        if k <= 0:
            return 0
        if computed == request.num_computed_tokens and not self.kv.can_allocate(
                request, num_new + k):
            return 0
        return k

    def _mirrors_prompt(self, request: Request) -> bool:
        """With a draft model, whether the runner's draft reads this request's prompt chunk
        as the target does (draft_lengths 0): it will draft for the request."""
        speculator = self.speculator
        return (speculator is not None and speculator.drafts_in_runner
                and request.pooling_params is None and speculator.num_to_draft(request) > 0)

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Whether the request's adapter (if any) fits beside the running ones: at most
        config.max_loras distinct adapters run at once (the runner's slots)."""
        lora = request.lora_int_id
        return (lora is None or lora in loras or self.config.max_loras is None
                or len(loras) < self.config.max_loras)

    def _unsent_tokens(self, request: Request) -> list[int]:
        """The request's token ids the runner does not hold yet (from now on it does)."""
        sent = self._runner_tokens[request.request_id]
        self._runner_tokens[request.request_id] = request.num_tokens
        # in the outputs (the prompt went whole with the request), without copying the list
        return request.output_token_ids[sent - request.num_prompt_tokens:]

    def _micro_batch_seqs(self, num_micro_batches: int) -> int:
        """The most requests one batch takes: all that may run, or, with several batches in
        flight, an even share of them (8 running over 2 batches: 4 each)."""
        limit = self.config.max_num_seqs
        if num_micro_batches == 1:
            return limit
        num_requests = min(len(self.running) + len(self.waiting), limit)
        return max(1, -(-num_requests // num_micro_batches))

    def _grammar_bitmask(self, num_scheduled: dict[str, int],
                         spec_token_ids: dict[str, list[int]]) -> Optional[GrammarBitmask]:
        """The allowed ids of each constrained request that samples this step (its grammar has
        consumed every output token so far, preemption or not): one row after its last token,
        and with drafts one more after each draft (the grammar's check_drafts), as the runner's
        verify rows. Drafts whose masks the request's mask budget has no room for are dropped
        here, from num_scheduled and spec_token_ids (their KV slots stay with the request, as
        a rejected draft's do)."""
        rows = [r for r in (self.requests[i] for i in num_scheduled) if r.grammar is not None
                and r.num_computed_tokens + num_scheduled[r.request_id]
                - len(spec_token_ids.get(r.request_id, ())) == r.num_tokens]
        if not rows:
            return None
        bitmask = allocate_bitmask(
            sum(1 + len(spec_token_ids.get(r.request_id, ())) for r in rows), self.vocab_size)
        req_ids: list[str] = []
        for request in rows:
            req_id, row = request.request_id, len(req_ids)
            drafts = spec_token_ids.get(req_id, [])
            try:
                request.grammar.fill_bitmask(bitmask, row)
                kept = request.grammar.check_drafts(drafts, bitmask, row) if drafts else 0
            except Exception as err:  # that request fails at the update; the batch goes on
                bitmask[row] = -1  # any token: it is discarded
                kept = 0
                self._errors[req_id] = f"structured output: {err!r}"
            if kept < len(drafts):
                num_scheduled[req_id] -= len(drafts) - kept
                if kept:
                    spec_token_ids[req_id] = drafts[:kept]
                else:
                    del spec_token_ids[req_id]
            req_ids += [req_id] * (1 + kept)
        return GrammarBitmask(req_ids, bitmask[:len(req_ids)])

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, finish requests that stopped.

        An exception while updating one request (its grammar, its stop checks) fails that
        request alone, with finish_reason "error"; the others go on. The output of a request
        finished (aborted) while its step was in flight is dropped."""
        outputs = []
        for req_id, n in sched.num_scheduled_tokens.items():
            request = self._in_flight.pop(req_id, None)
            if (request is None or self.requests.get(req_id) is not request
                    or request.status != RequestStatus.RUNNING):
                continue
            error = self._errors.pop(req_id, None) or out.errors.get(req_id)
            if error is None:
                try:
                    core_out = self._advance(request, n, out,
                                             sched.spec_token_ids.get(req_id, []))
                except Exception as err:
                    logger.exception("request %s: updating it failed", req_id)
                    error = f"{type(err).__name__}: {err}"
            if error is not None:
                core_out = self._fail(request, error)
            if core_out.new_token_ids or core_out.new_prompt_logprobs or core_out.finished:
                outputs.append(core_out)
        return outputs

    def _advance(self, request: Request, n: int, out: ModelRunnerOutput,
                 drafts: list[int]) -> EngineCoreOutput:
        """One request's progress in this step: computed tokens, its sampled tokens (the drafts
        kept and the target's own after them, or the one token of a plain step), its stop.
        The KV of rejected drafts is given up: the computed count stops after the last kept
        one (their slots are written again by the next step; no block holding them is in the
        prefix cache, which hashes whole blocks of known tokens only)."""
        req_id = request.request_id
        request.num_computed_tokens += n
        core_out = EngineCoreOutput(req_id, [], num_cached_tokens=request.num_cached_tokens)
        if request.pooling_params is not None:
            return self._pooled(request, out, core_out)
        if req_id in out.prompt_logprobs:
            core_out.new_prompt_logprobs = out.prompt_logprobs[req_id]
        if drafts:
            tokens = out.spec_token_ids[req_id]
            request.num_computed_tokens -= len(drafts) + 1 - len(tokens)
            assert self.speculator is not None
            self.speculator.record(request, len(drafts), len(tokens) - 1)
            logprobs = out.spec_logprobs.get(req_id, [])
        else:
            token = out.sampled.get(req_id)
            tokens = [] if token is None else [token]
            logprobs = [out.logprobs[req_id]] if req_id in out.logprobs else []
        if tokens:  # a draft model's drafts continue exactly these tokens (or none came)
            request.draft_token_ids = out.draft_token_ids.get(req_id, [])
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            if request.grammar is not None and not request.grammar.accept(token):
                logger.warning("request %s: the grammar rejected token %d (%s)", req_id,
                               token, request.grammar.error)
            core_out.new_token_ids.append(token)
            if logprobs:
                core_out.new_logprobs.append(logprobs[i])
            status = self._check_stop(request, token)
            if status is not None:  # the tokens after a stop are dropped
                self._finish(request, status)
                core_out.finish_reason = status.finish_reason
                core_out.stop_reason = request.stop_reason
                if status == RequestStatus.FINISHED_ERROR:
                    logger.error("request %s failed: %s", req_id, request.error)
                    core_out.error = request.error
                break
        return core_out

    def _pooled(self, request: Request, out: ModelRunnerOutput,
                core_out: EngineCoreOutput) -> EngineCoreOutput:
        """A pooling request after the step that read its last token: finished with its vector,
        its blocks freed (after an earlier chunk, nothing yet)."""
        if request.num_computed_tokens != request.num_tokens:
            if self.config.chunked_pooling:
                return core_out
            raise RuntimeError(f"pooling request ran {request.num_computed_tokens} of its "
                               f"{request.num_tokens} tokens in one step")
        pooled = out.pooled.get(request.request_id)
        if pooled is None:
            raise RuntimeError("the model runner returned no pooled output for it")
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        core_out.pooled, core_out.finish_reason = pooled, "stop"
        return core_out

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        """Finish a request whose own step failed; its output says why."""
        logger.error("request %s failed: %s", request.request_id, error)
        request.error = error
        if self.requests.get(request.request_id) is request:  # not finished before it failed
            self._finish(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request.request_id, [], finish_reason="error", error=error)

    # ---- helpers ------------------------------------------------------------
    def _check_stop(self, request: Request, token: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if request.grammar is not None and request.grammar.error is not None:
            # the grammar engine gave up (e.g. llguidance's row limit): the output is not whole,
            # so it must not look like a complete one ("stop")
            first_line = request.grammar.error.strip().splitlines()[0][:300]
            request.error = f"the grammar engine stopped: {first_line}"
            return RequestStatus.FINISHED_ERROR
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the output is complete
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def _preemption_victim(self) -> Request:
        """The most recently admitted running request without a step in flight (the one being
        scheduled at worst, so there always is one)."""
        return next(r for r in reversed(self.running) if r.request_id not in self._in_flight)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)  # the runner keeps its state (e.g. the RNG) until finish

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._errors.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        self.kv.free(request)
        self._forget_in_runner(request.request_id)
        del self.requests[request.request_id]

    def _forget_in_runner(self, req_id: str) -> None:
        if self._runner_tokens.pop(req_id, None) is not None:
            self._finished_ids.add(req_id)
