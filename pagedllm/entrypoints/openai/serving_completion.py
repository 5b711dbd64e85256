"""POST /v1/completions: one or many prompts, streaming or not."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional, Union

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_common import (SSE_DONE, OpenAIError, ServerContext,
                                                        bad_request, check_n, new_id, now,
                                                        sse, start_prompts, usage)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


def _prompts(req: CompletionRequest) -> list[Union[str, dict]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError("prompt must not be empty", 400, "prompt")
    if all(isinstance(t, int) for t in p):
        return [{"prompt_token_ids": p}]
    return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


def _params(ctx: ServerContext, req: CompletionRequest) -> SamplingParams:
    if req.suffix is not None:
        raise OpenAIError("suffix is not supported", 400, "suffix")
    check_n(req.n, req.best_of)
    try:
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        return req.sampling_params(max_tokens, ctx.engine.default_sampling_params(),
                                   req.logprobs)
    except ValueError as err:
        raise bad_request(err) from None


def _logprobs(tokenizer, comp: CompletionOutput, offset: int,
              first_token: int = 0) -> Optional[dict[str, Any]]:
    """OpenAI's completion logprobs for the tokens from first_token on."""
    if comp.logprobs is None:
        return None
    tokens, token_lp, top, offsets = [], [], [], []
    for tok, lp in zip(comp.token_ids[first_token:], comp.logprobs[first_token:]):
        text = tokenizer.decode([tok])
        tokens.append(text)
        token_lp.append(lp[tok].logprob)
        top.append({tokenizer.decode([t]): v.logprob for t, v in lp.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top,
            "text_offset": offsets}


async def create_completion(ctx: ServerContext, req: CompletionRequest):
    """The JSON response, or an async iterator of SSE lines when req.stream."""
    model = ctx.check_model(req.model)
    prompts = _prompts(req)
    params = _params(ctx, req)
    rid = new_id("cmpl")
    gens = start_prompts(ctx.engine, prompts, params, rid)
    if req.stream:
        return _stream(ctx, req, model, rid, gens)
    finals = await asyncio.gather(*(_last(g) for g in gens))
    return _response(ctx, req, model, rid, finals)


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in gen:
        pass
    return out


def _response(ctx: ServerContext, req: CompletionRequest, model: str, rid: str,
              finals: list[RequestOutput]) -> dict[str, Any]:
    tok = ctx.engine.tokenizer
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        prefix = (out.prompt or tok.decode(out.prompt_token_ids)) if req.echo else ""
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            choices.append({"index": i * req.n + comp.index, "text": prefix + comp.text,
                            "logprobs": _logprobs(tok, comp, len(prefix)),
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


async def _stream(ctx: ServerContext, req: CompletionRequest, model: str, rid: str,
                  gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    created = now()
    queue: asyncio.Queue = asyncio.Queue()
    sent: dict[int, int] = {}  # choice index -> characters sent
    sent_tokens: dict[int, int] = {}  # choice index -> tokens whose logprobs were sent
    done: set[int] = set()  # choices whose finish chunk went out: outputs repeat them
    tok = ctx.engine.tokenizer

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as err:  # forwarded to the response as an error event
            await queue.put((i, err))
        finally:
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
                err = item if isinstance(item, OpenAIError) else OpenAIError(str(item), 500)
                yield sse(err.body())
                break
            for comp in item.outputs:
                idx = i * req.n + comp.index
                if idx in done:
                    continue
                start = sent.get(idx)
                text = comp.text[start or 0:]
                if start is None and req.echo:
                    text = (item.prompt or tok.decode(item.prompt_token_ids)) + text
                if not text and comp.finish_reason is None:
                    continue
                logprobs = _logprobs(tok, comp, sent.get(idx, 0), sent_tokens.get(idx, 0))
                sent[idx], sent_tokens[idx] = len(comp.text), len(comp.token_ids)
                completion_tokens[idx] = len(comp.token_ids)
                if comp.finish_reason is not None:
                    done.add(idx)
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": model, "choices": [{
                               "index": idx, "text": text, "logprobs": logprobs,
                               "finish_reason": comp.finish_reason,
                               "stop_reason": comp.stop_reason}]})
            if item.finished:
                prompt_tokens += len(item.prompt_token_ids)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens.values()))})
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
