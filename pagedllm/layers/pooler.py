"""Pooling: one sequence's hidden states -> one vector (sentence-transformers' Pooling module),
cut to a request's dimensions and L2-normalised (its Normalize module), in float32. A model
with a classification head (a cross-encoder, a classifier, a decoder reranker) instead gives
its pooled row ([CLS], or a decoder's last token) to the head and returns the logits through
the task's activation: classify's probabilities, score's relevance."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.nn import functional as F

from pagedllm.config import ClassifierConfig, PoolerConfig
from pagedllm.pooling_params import PoolingParams

Head = Callable[[torch.Tensor], torch.Tensor]  # [N, H] pooled rows -> [N, labels] logits


def activate(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """A head's float32 logits [labels] through sigmoid, softmax or nothing."""
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits


class Pooler:
    """CLS, mean or last-token pooling over each sequence's rows of the step's hidden states;
    with a head, the head's activated logits from the pooled rows ([CLS] or last token)."""

    def __init__(self, config: PoolerConfig, head: Optional[Head] = None,
                 classifier: Optional[ClassifierConfig] = None) -> None:
        if (head is None) != (classifier is None):
            raise ValueError("a classification head and its config come together")
        if head is not None and config.pooling_type == "mean":
            raise ValueError("a classification head reads one row: cls or last pooling")
        self.config, self.head, self.classifier = config, head, classifier

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
        """One float32 CPU vector per (first row, tokens) span of hidden [T, H]."""
        if self.head is not None:
            return self._classified(hidden, spans, params)
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

    def _classified(self, hidden: torch.Tensor, spans: list[tuple[int, int]],
                    params: list[Optional[PoolingParams]]) -> list[torch.Tensor]:
        """The head over every sequence's pooled row ([CLS], or the last token) in one call,
        then each request's task activation (score's or classify's; none with
        use_activation=False)."""
        assert self.head is not None and self.classifier is not None
        last = self.config.pooling_type == "last"
        rows = torch.tensor([start + n - 1 if last else start for start, n in spans],
                            dtype=torch.int64, device=hidden.device)
        logits = self.head(hidden.index_select(0, rows)).float()
        out = []
        for row, p in zip(logits, params):
            kind = (self.classifier.score_activation if p is not None and p.task == "score"
                    else self.classifier.classify_activation)
            if p is not None and p.use_activation is False:
                kind = "identity"
            out.append(activate(row, kind).cpu())
        return out
