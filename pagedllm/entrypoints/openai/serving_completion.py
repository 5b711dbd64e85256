"""POST /v1/completions: one or many prompts, streaming or not."""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional, Union

from pagedllm.engine.input_processor import no_tokens_error
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_common import (SSE_DONE, OpenAIError, ServerContext,
                                                        bad_request, check_n,
                                                        check_prompt_count, compile_grammar,
                                                        new_id, now,
                                                        prompt_logprobs_json, sse,
                                                        start_prompts, stream_error, usage)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


def _prompts(req: CompletionRequest) -> list[Union[str, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError("prompt must not be empty", 400, "prompt")
    if all(isinstance(t, int) for t in p):
        return [p]
    return p


async def _engine_prompts(ctx: ServerContext, prompts: list[Union[str, list[int]]]) -> list[dict]:
    """Each prompt as the engine's {"prompt", "prompt_token_ids"}: texts length-checked, then
    tokenized off the event loop; token-id prompts length-checked (a 400 naming prompt[i])."""
    fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    texts = [(f, p) for f, p in zip(fields, prompts) if isinstance(p, str)]
    try:
        for f, text in texts:
            if not text:
                raise ValueError(f"{f} must not be empty")
        encoded = iter(await ctx.tokens.encode([t for _, t in texts], [f for f, _ in texts]))
        out = []
        for f, p in zip(fields, prompts):
            ids = next(encoded) if isinstance(p, str) else p
            if isinstance(p, str) and not ids:
                raise no_tokens_error(f)
            ctx.tokens.check_ids(ids, f)
            out.append({"prompt_token_ids": ids, **({"prompt": p} if isinstance(p, str) else {})})
        return out
    except ValueError as err:
        raise bad_request(err) from None


def _params(ctx: ServerContext, req: CompletionRequest) -> SamplingParams:
    if req.suffix is not None:
        raise OpenAIError("suffix is not supported", 400, "suffix")
    check_n(req.n, req.best_of)
    try:
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if max_tokens == 0:  # score the prompt only (lm-eval's log-likelihood requests)
            if not req.echo:
                raise ValueError("max_tokens must be >= 1; 0 is allowed only with echo, to "
                                 "score the prompt")
            max_tokens = 1  # the one token drawn is left out of the answer (_prompt_only)
        params = req.sampling_params(max_tokens, ctx.engine.default_sampling_params(),
                                     req.logprobs)
        if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs
            params = dataclasses.replace(params, prompt_logprobs=max(
                req.logprobs, params.prompt_logprobs or 0))
        return params
    except ValueError as err:
        raise bad_request(err) from None


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """The output with its generated token dropped (max_tokens 0: the prompt alone)."""
    comps = [dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                 logprobs=[] if c.logprobs is not None else None,
                                 finish_reason="length" if c.finish_reason else None,
                                 stop_reason=None) for c in out.outputs]
    return dataclasses.replace(out, outputs=comps)


class _Logprobs:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, tokenizer, as_ids: bool) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def name(self, token_id: int) -> str:
        """A token as the response names it."""
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])

    def build(self, pairs, offset: int) -> dict[str, Any]:
        """For (token id, {id: Logprob} or None) pairs, starting at text offset `offset`."""
        tokens, token_lp, top, offsets = [], [], [], []
        for tok, lp in pairs:
            text = self.tokenizer.decode([tok])
            tokens.append(self.name(tok))
            token_lp.append(None if lp is None else lp[tok].logprob)
            top.append(None if lp is None else {self.name(t): v.logprob for t, v in lp.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top,
                "text_offset": offsets}

    def choice(self, out: RequestOutput, comp: CompletionOutput, offset: int,
               with_prompt: bool) -> Optional[dict[str, Any]]:
        """The logprobs of comp's tokens, after the prompt's if echoed; text offsets from
        `offset`."""
        if comp.logprobs is None:
            return None
        pairs = list(zip(comp.token_ids, comp.logprobs))
        if with_prompt and out.prompt_logprobs is not None:
            pairs = list(zip(out.prompt_token_ids, out.prompt_logprobs)) + pairs
            offset = 0
        return self.build(pairs, offset)


async def create_completion(ctx: ServerContext, req: CompletionRequest,
                            client: Optional[str] = None):
    """The JSON response, or an async iterator of SSE lines when req.stream; client: who sent
    it, for --max-client-share."""
    model = ctx.check_model(req.model)
    prompts = _prompts(req)
    check_prompt_count(ctx.engine, len(prompts))
    params = _params(ctx, req)
    prompts = await _engine_prompts(ctx, prompts)
    grammar = await compile_grammar(ctx.engine, params)
    rid = new_id("cmpl")
    gens = await start_prompts(ctx, prompts, params, rid, client, grammar, ctx.lora_for(model))
    if req.stream:
        return _stream(ctx, req, model, rid, gens)
    finals = await asyncio.gather(*(_last(g) for g in gens))
    if req.max_tokens == 0:
        finals = [_prompt_only(f) for f in finals]
    return _response(ctx, req, model, rid, finals)


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in gen:
        pass
    return out


def _response(ctx: ServerContext, req: CompletionRequest, model: str, rid: str,
              finals: list[RequestOutput]) -> dict[str, Any]:
    tok = ctx.engine.tokenizer
    lps = _Logprobs(tok, req.return_tokens_as_token_ids)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        prefix = (out.prompt or tok.decode(out.prompt_token_ids)) if req.echo else ""
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            choice = {"index": i * req.n + comp.index, "text": prefix + comp.text,
                      "logprobs": lps.choice(out, comp, len(prefix), req.echo),
                      "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            choices.append(_extras(req, out, comp, choice, full=True))
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def _extras(req: CompletionRequest, out: RequestOutput, comp: CompletionOutput,
            choice: dict[str, Any], full: bool) -> dict[str, Any]:
    """vLLM's optional per-choice fields: prompt_logprobs, prompt_token_ids, token_ids."""
    if req.prompt_logprobs is not None and full:
        choice["prompt_logprobs"] = prompt_logprobs_json(out)
    if req.return_token_ids:
        if full:
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        choice["token_ids"] = list(comp.token_ids)
    return choice


async def _stream(ctx: ServerContext, req: CompletionRequest, model: str, rid: str,
                  gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """Each output is a delta (RequestOutputKind.DELTA): a choice's new text, the tokens that
    made it and their logprobs; its first chunk carries the echoed prompt."""
    created = now()
    # bounded: when the client stops reading, the pumps stop taking from the engine's streams,
    # whose own bound (--max-stream-backlog) then aborts the requests
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(gens))
    sent: dict[int, int] = {}  # choice index -> characters sent (logprobs' text_offset)
    tok = ctx.engine.tokenizer
    lps = _Logprobs(tok, req.return_tokens_as_token_ids)
    opts = req.stream_options

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        # cancelled (the response is over): nothing more is put, the queue may be full
        try:
            async with aclosing(gen):
                async for out in gen:
                    await queue.put((i, out))
        except Exception as err:  # forwarded to the response as an error event
            await queue.put((i, err))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    open_prompts, prompt_tokens, completion_tokens = len(gens), 0, {}
    try:
        while open_prompts:
            i, item = await queue.get()
            if item is None:
                open_prompts -= 1
                continue
            if isinstance(item, Exception):
                yield sse(stream_error(item).body())
                break
            if req.max_tokens == 0:
                item = _prompt_only(item)
            for comp in item.outputs:
                idx = i * req.n + comp.index
                first = idx not in sent
                text = comp.text
                if first and req.echo:
                    text = (item.prompt or tok.decode(item.prompt_token_ids)) + text
                logprobs = lps.choice(item, comp, sent.get(idx, 0), req.echo and first)
                sent[idx] = sent.get(idx, 0) + len(comp.text)
                completion_tokens[idx] = completion_tokens.get(idx, 0) + len(comp.token_ids)
                choice = _extras(req, item, comp, {
                    "index": idx, "text": text, "logprobs": logprobs,
                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason},
                    full=first)
                chunk = {"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": [choice]}
                if opts and opts.continuous_usage_stats:
                    chunk["usage"] = usage(len(item.prompt_token_ids), completion_tokens[idx])
                yield sse(chunk)
            if item.finished:
                prompt_tokens += len(item.prompt_token_ids)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens.values()))})
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
