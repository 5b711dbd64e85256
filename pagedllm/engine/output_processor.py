"""Turns engine-core progress into RequestOutput objects: text, logprobs, stop strings, n samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.core.outputs import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class _SampleState:
    """One child sequence of a request."""

    index: int
    params: SamplingParams
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    # every token's (CUMULATIVE, FINAL_ONLY) or, for DELTA, those not yet sent: a stream's
    # 4000 tokens x 20 logprobs would otherwise stay in memory (~3 KB a token) until it ends
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    # RequestOutputKind.DELTA: how much was sent, and whether its finish went out
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class _ParentState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_SampleState]
    prompt_logprobs: Optional[PromptLogprobs] = None
    error: Optional[str] = None  # why the request failed (its samples finish with "error")
    sent_any: bool = False  # DELTA: prompt logprobs go with the first output only

    @property
    def kind(self) -> RequestOutputKind:
        """What each output carries (every sample has the request's params)."""
        return self.samples[0].params.output_kind

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Keeps per-request output state; one process() call per engine step."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, tuple[_ParentState, _SampleState]] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    children: list[tuple[str, SamplingParams]]) -> None:
        """Register a user request and the ids of its child sequences (one per sample)."""
        samples = [self._new_sample(i, params) for i, (_, params) in enumerate(children)]
        parent = _ParentState(request_id, prompt, list(prompt_token_ids), samples)
        if children[0][1].prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self._parents[request_id] = parent
        for (child_id, _), sample in zip(children, samples):
            self._children[child_id] = (parent, sample)

    def child_ids(self, request_id: str) -> list[str]:
        """Engine-core ids of a user request's samples that are still tracked."""
        return [cid for cid, (p, _) in self._children.items() if p.request_id == request_id]

    def has_unfinished(self) -> bool:
        """Any request still producing."""
        return bool(self._parents)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step; returns updated RequestOutputs and child ids to abort (stop strings,
        failed requests).

        An exception while handling one request (detokenizing, stop strings, logprobs) fails
        that request, all its samples, with finish_reason "error"; the others go on."""
        touched: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            entry = self._children.get(out.req_id)
            if entry is None:
                continue
            parent, sample = entry
            touched[parent.request_id] = parent
            error = out.error
            if error is None:
                try:
                    self._apply(parent, sample, out, to_abort)
                except Exception as err:
                    logger.exception("request %s: processing its output failed",
                                     parent.request_id)
                    error = f"{type(err).__name__}: {err}"
            if error is not None:
                to_abort.extend(self._fail(parent, error))
        results = []
        for parent in touched.values():
            try:
                output = self._make_output(parent)
            except Exception as err:
                logger.exception("request %s: making its output failed", parent.request_id)
                to_abort.extend(self._fail(parent, f"{type(err).__name__}: {err}"))
                output = self._make_output(parent, with_text=False)
            if output is not None:
                results.append(output)
            if parent.finished:
                del self._parents[parent.request_id]
        return results, to_abort

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Forget a user request; returns its last output marked aborted (None if unknown or
        nothing is left to report)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for sample in parent.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        for cid in [c for c, (p, _) in self._children.items() if p is parent]:
            del self._children[cid]
        return self._make_output(parent)

    # ---- helpers ------------------------------------------------------------
    def _apply(self, parent: _ParentState, sample: _SampleState, out: EngineCoreOutput,
               to_abort: list[str]) -> None:
        """One child's progress: prompt logprobs, tokens, text, stop strings, finish."""
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._logprob_dict(lp) for lp in out.new_prompt_logprobs)
        stop = self._apply_tokens(sample, out)
        if stop is not None and out.finish_reason is None:
            to_abort.append(out.req_id)
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if sample.finish_reason is not None:
            del self._children[out.req_id]

    def _fail(self, parent: _ParentState, error: str) -> list[str]:
        """Finish every sample of a failed request with "error"; the child ids to abort."""
        parent.error = error
        for sample in parent.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "error"
        child_ids = [c for c, (p, _) in self._children.items() if p is parent]
        for cid in child_ids:
            del self._children[cid]
        return child_ids

    def _new_sample(self, index: int, params: SamplingParams) -> _SampleState:
        detok = IncrementalDetokenizer(self.tokenizer, params) if params.detokenize else None
        sample = _SampleState(index, params, detok)
        if params.logprobs is not None:
            sample.logprobs, sample.cumulative_logprob = [], 0.0
        return sample

    def _apply_tokens(self, sample: _SampleState, out: EngineCoreOutput) -> Optional[str]:
        if sample.finish_reason is not None:
            return None
        tokens, stop = out.new_token_ids, None
        if sample.detokenizer is not None:
            stop = sample.detokenizer.update(tokens)
            # tokens a speculative step brought after the one that ended a stop string are
            # dropped, as a plain step would never have produced them
            tokens = tokens[:sample.detokenizer.num_used]
        sample.token_ids.extend(tokens)
        if sample.logprobs is not None:
            for lp in out.new_logprobs[:len(tokens)]:
                sample.logprobs.append(self._logprob_dict(lp))
                sample.cumulative_logprob += lp.logprobs[0]
        return stop

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for col, (tok, val) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tok in d:
                continue
            rank = lp.rank if col == 0 else col
            d[tok] = Logprob(val, rank, self.tokenizer.decode([tok]))
        return d

    def _make_output(self, parent: _ParentState,
                     with_text: bool = True) -> Optional[RequestOutput]:
        """The request's output for this step as its output_kind asks; None when there is
        nothing to send (FINAL_ONLY before the end; DELTA with nothing new)."""
        if parent.kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        if parent.kind == RequestOutputKind.DELTA:
            return self._make_delta(parent, with_text)
        outputs = [CompletionOutput(
            index=s.index,
            text=(s.detokenizer.output_text(s.finish_reason is not None)
                  if s.detokenizer and with_text else ""),
            token_ids=list(s.token_ids), cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in parent.samples]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             parent.prompt_logprobs, outputs, parent.finished, parent.error)

    def _make_delta(self, parent: _ParentState, with_text: bool) -> Optional[RequestOutput]:
        """What is new since the last output, per sample: its new text and the tokens (and
        logprobs) that made it. A sample shows up when its text grew (tokens that add no text
        yet, e.g. half a character or a possible stop string, wait for the text) or it finished;
        never again after its finish. Prompt logprobs go with the request's first output."""
        outputs = []
        for s in parent.samples:
            if s.sent_finish:
                continue
            finished = s.finish_reason is not None
            text = (s.detokenizer.output_text(finished)
                    if s.detokenizer is not None and with_text else "")
            new_text = text[s.sent_chars:]
            grew = bool(new_text) if s.detokenizer is not None else len(s.token_ids) > s.sent_tokens
            if not (grew or finished):
                continue
            outputs.append(CompletionOutput(
                index=s.index, text=new_text, token_ids=s.token_ids[s.sent_tokens:],
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            s.sent_chars, s.sent_tokens = max(s.sent_chars, len(text)), len(s.token_ids)
            if s.logprobs is not None:
                s.logprobs = []
            s.sent_finish = finished
        if not outputs:
            return None
        prompt_logprobs = None if parent.sent_any else parent.prompt_logprobs
        parent.sent_any = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             prompt_logprobs, outputs, parent.finished, parent.error)
