"""Pooling: one sequence's hidden states -> one vector (sentence-transformers' Pooling module),
cut to a request's dimensions and L2-normalised (its Normalize module), in float32."""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from pagedllm.config import PoolerConfig
from pagedllm.pooling_params import PoolingParams


class Pooler:
    """CLS, mean or last-token pooling over each sequence's rows of the step's hidden states."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] of one whole sequence -> [H] float32."""
        kind = self.config.pooling_type
        if kind == "cls":
            return hidden[0].float()
        if kind == "last":
            return hidden[-1].float()
        return hidden.float().mean(dim=0)

    def __call__(self, hidden: torch.Tensor, spans: list[tuple[int, int]],
                 params: list[Optional[PoolingParams]]) -> list[torch.Tensor]:
        """One [D] float32 CPU vector per (first row, tokens) span of hidden [T, H]."""
        out = []
        for (start, n), p in zip(spans, params):
            vec = self.pool(hidden[start:start + n])
            if p is not None and p.dimensions is not None:
                vec = vec[:p.dimensions]  # Matryoshka: cut first, then normalise (as vLLM)
            normalize = self.config.normalize if p is None or p.normalize is None else p.normalize
            if normalize:
                vec = F.normalize(vec, p=2.0, dim=0)
            out.append(vec.cpu())
        return out
