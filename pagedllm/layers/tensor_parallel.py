"""The collectives of a tensor-parallel model, as wrappers put around its loaded modules
(gpt-fast's way: the model code knows nothing of them). Each wraps whatever module is there
(float, GGML blocks, quantized at load), so they go in once every swap is done.

- ReducedOutput: a row-parallel projection (o_proj, down_proj), or a whole MoE block (its
  experts' and shared expert's partial sums added first): the partial sums of every rank
  summed by one all-reduce, then the bias, added once.
- VocabParallelEmbedding: a contiguous range of the vocabulary; ids outside it give zero rows,
  and the all-reduce fills each row from the rank that holds it.
- GatheredLogits: the head's contiguous vocabulary range, the ranks' logits gathered on every
  rank (only rank 0 samples, but the logits are small beside a step's compute).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.comm_stats import TP_COMM_STATS
from pagedllm.distributed.tensor_parallel import all_gather_last, all_reduce


class ReducedOutput(nn.Module):
    """y = sum over ranks of inner(x), + bias (the inner module's, moved here: added once)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.bias: Optional[torch.Tensor] = getattr(inner, "bias", None)
        if self.bias is not None:
            inner.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.inner(x).contiguous())  # [T, H]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + inner's rows) of the embedding; the others come from their ranks."""

    def __init__(self, inner: nn.Module, start: int, rows: int) -> None:
        super().__init__()
        self.inner, self.start, self.rows = inner, start, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        TP_COMM_STATS.forwards += 1  # the first collective of every step: counts the steps
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)  # [T]
        out = self.inner(torch.where(inside, local, 0))  # [T, H]
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        return all_reduce(out.contiguous())

    def extra_repr(self) -> str:
        return f"vocab=[{self.start}, {self.start + self.rows})"


class GatheredLogits(nn.Module):
    """The full vocabulary's logits [N, V] from each rank's [N, V / ranks], on every rank."""

    def __init__(self, inner: nn.Module, world_size: int) -> None:
        super().__init__()
        self.inner, self.world_size = inner, world_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last(self.inner(hidden), self.world_size)
