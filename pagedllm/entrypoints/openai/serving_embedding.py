"""POST /v1/embeddings (and vLLM's /pooling): every input pooled by the engine, answered in
OpenAI's shape (vLLM's for /pooling)."""
from __future__ import annotations

import asyncio
import base64
from typing import Any, Optional, Union

import numpy as np

from pagedllm.engine.async_engine import EngineDeadError, EngineOverloadedError
from pagedllm.engine.input_processor import no_tokens_error
from pagedllm.entrypoints.openai.embeddings_protocol import EmbeddingRequest, PoolingRequest
from pagedllm.entrypoints.openai.serving_common import (OpenAIError, ServerContext, bad_request,
                                                        check_prompt_count, new_id, now)
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams, resolve_truncation


async def engine_inputs(ctx: ServerContext, inputs: list[Union[str, list[int]]],
                        field: str = "input", keep: Optional[int] = None,
                        how_to_cut: str = "set truncate_prompt_tokens") -> list[dict]:
    """Each input as the engine's {"prompt", "prompt_token_ids"}, texts tokenized off the event
    loop (a 400 naming input[i] for an empty one). keep (truncate_prompt_tokens, -1:
    max_model_len): a longer text is cut by the tokenizer from the right, its special tokens
    kept, and the engine keeps the last `keep` of longer token ids (vLLM's rules); without it a
    longer input is refused (how_to_cut: what its message advises)."""
    fields = [field] if len(inputs) == 1 else [f"{field}[{i}]" for i in range(len(inputs))]
    keep = resolve_truncation(keep, ctx.max_model_len)
    texts = [(f, p) for f, p in zip(fields, inputs) if isinstance(p, str)]
    for f, text in texts:
        if not text:
            raise ValueError(f"{f} must not be empty")
    tokenizer = ctx.engine.tokenizer
    encoded = iter(await ctx.tokens.run(
        lambda: [tokenizer.encode(t) if keep is None else tokenizer.encode_truncated(t, None, keep)[0]
                 for _, t in texts]))
    out = []
    for f, p in zip(fields, inputs):
        ids = next(encoded) if isinstance(p, str) else p
        if isinstance(p, str) and not ids:
            raise no_tokens_error(f)
        if not ids:
            raise ValueError(f"{f} must not be empty")
        bad = next((t for t in ids if not 0 <= t < ctx.engine.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{f} must be token ids in [0, {ctx.engine.vocab_size}), got {bad}")
        if keep is None and len(ids) > ctx.max_model_len:
            raise ValueError(f"{f} is {len(ids)} tokens long but max_model_len is "
                             f"{ctx.max_model_len}: shorten the input or {how_to_cut}")
        out.append({"prompt_token_ids": ids, **({"prompt": p} if isinstance(p, str) else {})})
    return out


def _encoded(vector: Any, encoding_format: str) -> Union[list[float], str]:
    """An embedding as floats, or as base64 of its float32 little-endian bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector.numpy(), dtype="<f4").tobytes()).decode()
    return vector.tolist()


async def pool_all(ctx: ServerContext, prompts: list[tuple[dict, PoolingParams]],
                   request_id: str) -> list[PoolingRequestOutput]:
    """Queue every (input, params) (sub-request ids request_id-0, -1, ...) and await them
    together; a bad input or a full queue cancels those already queued."""
    tasks: list[asyncio.Future] = []
    try:
        for i, (prompt, params) in enumerate(prompts):
            coro = ctx.engine.encode(prompt, params, f"{request_id}-{i}")
            tasks.append(asyncio.ensure_future(coro))  # admitted in order, when they start
        return list(await asyncio.gather(*tasks))
    except BaseException as err:
        for task in tasks:
            task.cancel()
        if isinstance(err, ValueError):
            raise bad_request(err) from None
        if isinstance(err, EngineOverloadedError):
            raise OpenAIError(str(err), 503) from None
        if isinstance(err, EngineDeadError):
            raise OpenAIError(str(err), 500) from None
        raise


def _params(req: EmbeddingRequest, task: Optional[str]) -> PoolingParams:
    try:
        return PoolingParams(task=task, dimensions=req.dimensions, normalize=req.normalize,
                             truncate_prompt_tokens=req.truncate_prompt_tokens)
    except ValueError as err:
        raise bad_request(err) from None


async def _pool_inputs(ctx: ServerContext, req: EmbeddingRequest, task: Optional[str],
                       prefix: str) -> tuple[str, list[PoolingRequestOutput]]:
    """The served model's name and every input's pooling output, in input order."""
    try:
        req.check_unsupported()
        model = ctx.check_model(req.model)
        inputs = req.inputs()
        check_prompt_count(ctx.engine, len(inputs))
        params = _params(req, task)
        prompts = await engine_inputs(ctx, inputs, "input", params.truncate_prompt_tokens)
    except ValueError as err:
        raise bad_request(err) from None
    return model, await pool_all(ctx, [(p, params) for p in prompts], new_id(prefix))


def _response(prefix: str, model: str, data: list[dict[str, Any]],
              outs: list[PoolingRequestOutput]) -> dict[str, Any]:
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"id": new_id(prefix), "object": "list", "created": now(), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest,
                           client: Optional[str] = None) -> dict[str, Any]:
    """The embeddings of every input, in input order, with the prompt tokens used."""
    model, outs = await _pool_inputs(ctx, req, "embed", "embd")
    return _response("embd", model, [
        {"object": "embedding", "index": i,
         "embedding": _encoded(out.outputs.data, req.encoding_format)}
        for i, out in enumerate(outs)], outs)


async def create_pooling(ctx: ServerContext, req: PoolingRequest) -> dict[str, Any]:
    """vLLM's /pooling: every input's pooled output as the model gives it (an embedding, or a
    classification head's probabilities), for the request's task (None: the model's own)."""
    model, outs = await _pool_inputs(ctx, req, req.task, "pool")
    return _response("pool", model, [
        {"object": "pooling", "index": i, "data": _encoded(out.outputs.data, req.encoding_format)}
        for i, out in enumerate(outs)], outs)
