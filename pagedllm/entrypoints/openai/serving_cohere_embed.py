"""POST /v2/embed (Cohere's embed API, as vLLM serves it): texts embedded by the engine, each
after the prompt its input_type names, answered in Cohere's shape.

The prompts are the model's own (loader/hf/pooling_files.input_type_prompts: config.json's
task_instructions, else config_sentence_transformers.json's prompts). No input_type, no prompt;
one the model does not define is a 400 listing those it does. This is the only place vLLM reads
those prompts: /v1/embeddings and LLM.embed embed the text as given, and default_prompt_name is
never applied.
"""
from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np

from pagedllm.entrypoints.openai.cohere_embed_protocol import CohereEmbedRequest
from pagedllm.entrypoints.openai.serving_common import (ServerContext, bad_request,
                                                        check_prompt_count, new_id)
from pagedllm.entrypoints.openai.serving_embedding import engine_inputs, pool_all
from pagedllm.pooling_params import PoolingParams

_SIGNED = 1 << 7  # binary: each packed byte as a signed int8 (Cohere's), ubinary as it is


def _texts(req: CohereEmbedRequest) -> list[str]:
    """The request's texts; images and mixed inputs refused by name."""
    for name in ("images", "inputs"):
        if getattr(req, name) is not None:
            raise ValueError(f"{name} is not supported: the model embeds text; send texts")
    if req.texts is None:
        raise ValueError("texts must be given (one of texts, images or inputs is required)")
    if not req.texts:
        raise ValueError("texts must not be empty")
    return req.texts


def _prompt(input_type: Optional[str], prompts: dict[str, str]) -> str:
    """The prefix input_type names ('' for none)."""
    if input_type is None:
        return ""
    if not prompts:
        raise ValueError(f"input_type {input_type!r} is not supported: this model defines no "
                         "prompts (config_sentence_transformers.json's prompts or config.json's "
                         "task_instructions)")
    if input_type not in prompts:
        raise ValueError(f"input_type {input_type!r} is not supported; supported: "
                         f"{', '.join(sorted(prompts))}")
    return prompts[input_type]


def _keep(req: CohereEmbedRequest) -> Optional[int]:
    """truncate_prompt_tokens for the request's truncate and max_tokens (END: cut to
    max_tokens, or to max_model_len; NONE: no cut)."""
    if req.truncate == "START":
        raise ValueError("truncate='START' (keep a text's end) is not supported; END and NONE "
                         "are")
    if req.truncate == "NONE":
        return None
    return req.max_tokens if req.max_tokens is not None else -1


def _packed(vectors: np.ndarray, signed: bool) -> list[list[int]]:
    """Each vector's signs as bits (>= 0: 1), eight to a byte, the first value highest."""
    if vectors.shape[1] % 8:
        raise ValueError(f"embedding_types binary and ubinary need a dimension that is a "
                         f"multiple of 8, got {vectors.shape[1]}")
    packed = np.packbits(vectors >= 0, axis=1).astype(np.int16)
    return (packed - _SIGNED if signed else packed).tolist()


def _typed(vectors: np.ndarray, types: list[str]) -> dict[str, Any]:
    """The embeddings as each type asked for: floats, signed or unsigned bits, base64 of
    little-endian float32."""
    out: dict[str, Any] = {}
    for kind in types:
        if kind == "float":
            out[kind] = vectors.tolist()
        elif kind in ("binary", "ubinary"):
            out[kind] = _packed(vectors, signed=kind == "binary")
        else:
            out[kind] = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    return out


async def create_cohere_embedding(ctx: ServerContext, req: CohereEmbedRequest,
                                  prompts: dict[str, str]) -> dict[str, Any]:
    """The embeddings of every text (after its input_type's prompt), in text order."""
    try:
        req.check_unsupported()
        if req.priority != 0:
            raise ValueError("priority is not supported by pagedllm")
        ctx.check_model(req.model)
        texts = _texts(req)
        check_prompt_count(ctx.engine, len(texts))
        prefix = _prompt(req.input_type, prompts)
        params = PoolingParams(task="embed", dimensions=req.output_dimension,
                               truncate_prompt_tokens=_keep(req))
        inputs = await engine_inputs(ctx, [prefix + t for t in texts], "texts",
                                     params.truncate_prompt_tokens, "set truncate to 'END'")
        if req.truncate == "NONE" and req.max_tokens is not None:
            for i, p in enumerate(inputs):
                if len(p["prompt_token_ids"]) > req.max_tokens:
                    raise ValueError(f"texts[{i}] is {len(p['prompt_token_ids'])} tokens long, "
                                     f"more than max_tokens={req.max_tokens} with "
                                     "truncate='NONE'; set truncate to 'END' to cut it")
        outs = await pool_all(ctx, [(p, params) for p in inputs], new_id("embd"))
        vectors = np.stack([out.outputs.data.float().numpy() for out in outs])
        embeddings = _typed(vectors, req.embedding_types or ["float"])
    except ValueError as err:
        raise bad_request(err) from None
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"id": new_id("embd"), "embeddings": embeddings, "texts": texts,
            "meta": {"api_version": {"version": "2"}, "tokens": {"input_tokens": tokens}}}
