"""POST /score, /rerank (and /v1/rerank, /v2/rerank) and /classify, answered in vLLM's shapes.

A cross-encoder (a one-label classification head) scores each (query, document) pair as one
input; an embedding model embeds each distinct text once and scores a pair by the cosine of
the two vectors (engine/scoring.py), as vLLM does for each kind."""
from __future__ import annotations

from typing import Any

from pagedllm.engine.scoring import as_texts, cosine, pair_requests, pair_up
from pagedllm.entrypoints.openai.scoring_protocol import (ClassifyRequest, PoolingFields,
                                                          RerankRequest, ScoreRequest)
from pagedllm.entrypoints.openai.serving_common import (ServerContext, bad_request,
                                                        check_prompt_count, new_id, now)
from pagedllm.entrypoints.openai.serving_embedding import engine_inputs, pool_all
from pagedllm.pooling_params import PoolingParams


def _params(req: PoolingFields, task: str) -> PoolingParams:
    try:
        return PoolingParams(task=task, truncate_prompt_tokens=req.truncate_prompt_tokens,
                             use_activation=req.use_activation)
    except ValueError as err:
        raise bad_request(err) from None


async def _inputs(ctx: ServerContext, texts: list[str], params: PoolingParams) -> list[dict]:
    """engine_inputs, its refusals (an empty text, truncate_prompt_tokens past max_model_len)
    a 400 naming the field."""
    try:
        return await engine_inputs(ctx, texts, "input", params.truncate_prompt_tokens)
    except ValueError as err:
        raise bad_request(err) from None


async def _scores(ctx: ServerContext, pairs: list[tuple[str, str]], req: PoolingFields,
                  fields: tuple[str, str]) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens read: a cross-encoder's, or the cosine of an
    embedding model's two vectors."""
    check_prompt_count(ctx.engine, len(pairs))
    if ctx.labels:
        params = _params(req, "score")
        try:  # a bad truncate_prompt_tokens is the request's fault: a 400 naming it
            prompts = await ctx.tokens.run(lambda: pair_requests(
                ctx.engine.tokenizer, pairs, ctx.max_model_len, params))
        except ValueError as err:
            raise bad_request(err) from None
        for i, (prompt, _) in enumerate(prompts):
            n = len(prompt["prompt_token_ids"])
            if n > ctx.max_model_len:
                name = fields[1] if len(pairs) == 1 else f"{fields[1]}[{i}]"
                raise bad_request(ValueError(
                    f"{name} with its {fields[0]} is {n} tokens long but max_model_len is "
                    f"{ctx.max_model_len}: shorten it or set truncate_prompt_tokens"))
        outs = await pool_all(ctx, prompts, new_id("score"))
        return ([float(o.outputs.data[0]) for o in outs],
                sum(len(o.prompt_token_ids) for o in outs))
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    params = _params(req, "embed")
    inputs = await _inputs(ctx, texts, params)
    outs = dict(zip(texts, await pool_all(ctx, [(p, params) for p in inputs], new_id("score"))))
    return ([cosine(outs[a].outputs.data, outs[b].outputs.data) for a, b in pairs],
            sum(len(o.prompt_token_ids) for o in outs.values()))


async def create_score(ctx: ServerContext, req: ScoreRequest) -> dict[str, Any]:
    """vLLM's /score: one score per pair, in pair order."""
    try:
        req.check_unsupported()
        model = ctx.check_model(req.model)
        pairs = pair_up(as_texts(req.text_1, "text_1"), as_texts(req.text_2, "text_2"))
    except ValueError as err:
        raise bad_request(err) from None
    scores, tokens = await _scores(ctx, pairs, req, ("text_1", "text_2"))
    return {"id": new_id("score"), "object": "list", "created": now(), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_rerank(ctx: ServerContext, req: RerankRequest) -> dict[str, Any]:
    """vLLM's (Jina's, Cohere's) /rerank: the documents best first, top_n of them."""
    try:
        req.check_unsupported()
        model = ctx.check_model(req.model)
        query = as_texts(req.query, "query")[0]
        documents = as_texts(req.documents, "documents")
        if req.top_n is not None and req.top_n < 0:
            raise ValueError(f"top_n must be >= 0 (0 or unset: every document), got {req.top_n}")
    except ValueError as err:
        raise bad_request(err) from None
    scores, tokens = await _scores(ctx, [(query, d) for d in documents], req,
                                   ("query", "documents"))
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if req.return_documents else {})}
               for i in order]
    return {"id": new_id("rerank"), "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_classify(ctx: ServerContext, req: ClassifyRequest) -> dict[str, Any]:
    """vLLM's /classify: each input's label (the most probable) and probabilities."""
    try:
        req.check_unsupported()
        model = ctx.check_model(req.model)
        texts = as_texts(req.input, "input")
        check_prompt_count(ctx.engine, len(texts))
        params = _params(req, "classify")
    except ValueError as err:
        raise bad_request(err) from None
    inputs = await _inputs(ctx, texts, params)
    outs = await pool_all(ctx, [(p, params) for p in inputs], new_id("classify"))
    names = ctx.engine.engine.config.arch.classifier.labels
    data = []
    for i, out in enumerate(outs):
        probs = out.outputs.data.tolist()
        data.append({"index": i, "label": names[max(range(len(probs)), key=probs.__getitem__)],
                     "probs": probs, "num_classes": len(probs)})
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"id": new_id("classify"), "object": "list", "created": now(), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

