"""Scoring text pairs (vLLM's LLM.score, /score, /rerank): which texts pair with which, the
prompts a cross-encoder runs, and an embedding model's cosine similarity.

A cross-encoder (a one-label classification head) reads each pair as one input, its two texts
told apart by token type; an embedding model embeds every text once and scores a pair by the
cosine of their vectors, as vLLM does for each kind."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch.nn import functional as F

from pagedllm.pooling_params import SECOND_TEXT, PoolingParams, resolve_truncation

Texts = Union[str, Sequence[str]]


def as_texts(value: Texts, field: str) -> list[str]:
    """A text or a list of texts as a non-empty list of non-empty strings, else a ValueError
    naming field (field[i] for one entry)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, (list, tuple)) or not texts:
        raise ValueError(f"{field} must be a string or a non-empty list of strings")
    for i, text in enumerate(texts):
        name = field if isinstance(value, str) else f"{field}[{i}]"
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{name} must not be empty")
    return list(texts)


def pair_up(first: list[str], second: list[str], names: tuple[str, str] = ("text_1", "text_2")
            ) -> list[tuple[str, str]]:
    """vLLM's pairing: one first text against every second text, else the two lists side by
    side (equal lengths)."""
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: "
                         f"pass one {names[0]}, or as many as {names[1]}")
    return list(zip(first, second))


def pair_requests(tokenizer: Any, pairs: list[tuple[str, str]], max_model_len: int,
                  params: Optional[PoolingParams] = None
                  ) -> list[tuple[dict[str, Any], PoolingParams]]:
    """Each pair as a cross-encoder's engine prompt and its PoolingParams (task "score", and
    where the second text starts): tokenized as the model's tokenizer joins a pair, cut to
    truncate_prompt_tokens (-1: max_model_len) if set."""
    base = PoolingParams(task="score") if params is None else params.clone()
    base.task = "score"
    keep = resolve_truncation(base.truncate_prompt_tokens, max_model_len)
    base.truncate_prompt_tokens = None  # the pair is cut here, as one input
    out = []
    for a, b in pairs:
        ids, second = tokenizer.encode_truncated(a, b, keep)
        p = base.clone()
        if second is not None:
            p.extra_kwargs = {SECOND_TEXT: second}
        out.append(({"prompt_token_ids": ids}, p))
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two embeddings."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))
