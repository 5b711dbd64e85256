"""A linear layer holding several checkpoint matrices side by side (q/k/v, gate/up).

One GEMM serves all of them; the checkpoint's separate tensors load into their row ranges by
shard id (nano-vllm's pattern), so model code never names the checkpoint's layout:

    qkv_proj.weight  [q rows | k rows | v rows] x in_features
    shard "q_proj"   -> rows [0, q)      shard "k_proj" -> rows [q, q + k)   ...
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class MergedLinear(nn.Module):
    """y_i = x W_i^T + b_i for each shard i, computed as one matmul; returns the shards' outputs."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool) -> None:
        super().__init__()
        if len(output_sizes) != len(shard_names):
            raise ValueError("one shard name per output size")
        self.in_features = in_features
        self.output_sizes, self.shard_names = tuple(output_sizes), tuple(shard_names)
        total = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.empty(total)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in_features] -> one [..., size_i] view per shard."""
        return F.linear(x, self.weight, self.bias).split(self.output_sizes, dim=-1)

    def shard_offset(self, shard: str) -> tuple[int, int]:
        """(first row, rows) of a shard, or a KeyError naming the shards."""
        if shard not in self.shard_names:
            raise KeyError(f"no shard {shard!r}; shards: {', '.join(self.shard_names)}")
        i = self.shard_names.index(shard)
        return sum(self.output_sizes[:i]), self.output_sizes[i]

    def shard_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint-relative names ("q_proj.weight", ...) -> the rows they load into (views)."""
        out = {}
        for name in self.shard_names:
            start, rows = self.shard_offset(name)
            out[f"{name}.weight"] = self.weight[start:start + rows]
            if self.bias is not None:
                out[f"{name}.bias"] = self.bias[start:start + rows]
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, shards={dict(zip(self.shard_names, self.output_sizes))}"
                f", bias={self.bias is not None}")
