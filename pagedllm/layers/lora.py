"""LoRA on top of a linear layer, per token: swapped in from outside, as quantization is, so
the model code knows nothing of it.

A LoRALinear holds its base module (dense, GGUF blocks, or merged q/k/v or gate/up shards:
the base stays as it was loaded, quantized or not) and, per shard, max_loras slots of float32
matrices. A step's tokens come in groups, one per adapter slot (vLLM's punica idea: gather the
group's rows, two small matmuls, scatter-add the delta); tokens of no adapter are in no group:

    y_shard[rows] += (x[rows] @ A[slot, :r]^T) @ Bt[slot, :r]      Bt = scale * B^T  [r, out]
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class LoRAGroup:
    """The step's token rows that run the adapter in one slot."""

    slot: int
    rows: torch.Tensor  # [n] int64, rows of the step's flattened tokens


_step_groups: ContextVar[tuple[LoRAGroup, ...]] = ContextVar("lora_groups", default=())


@contextmanager
def set_lora_groups(groups: tuple[LoRAGroup, ...]) -> Iterator[None]:
    """LoRALinear layers called inside add the deltas of these groups."""
    token = _step_groups.set(groups)
    try:
        yield
    finally:
        _step_groups.reset(token)


class LoRALinear(nn.Module):
    """base(x) plus each token group's LoRA delta, per output shard."""

    def __init__(self, base: nn.Module, in_features: int, shard_sizes: Sequence[int],
                 max_loras: int, max_rank: int, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
        self.a = [zeros(max_loras, max_rank, in_features) for _ in shard_sizes]  # A per slot
        self.bt = [zeros(max_loras, max_rank, n) for n in shard_sizes]  # scale * B^T per slot
        self.ranks = [[0] * max_loras for _ in shard_sizes]  # 0: the slot leaves the shard alone

    def set_slot(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor,
                 scale: float) -> None:
        """Load one adapter's A [r, in] and B [out, r] for a shard into a slot."""
        r = a.shape[0]
        self.a[shard][slot, :r].copy_(a)
        self.bt[shard][slot, :r].copy_(b.t() * scale)
        self.ranks[shard][slot] = r

    def clear_slot(self, slot: int) -> None:
        """The slot adds nothing to any shard until set again."""
        for ranks in self.ranks:
            ranks[slot] = 0

    def forward(self, x: torch.Tensor):
        """x [T, in] -> the base's output (a tensor, or a tuple of shard views), deltas added."""
        y = self.base(x)
        groups = _step_groups.get()
        if not groups:
            return y
        outs = y if isinstance(y, tuple) else (y,)
        for g in groups:
            xg = None
            for shard, out in enumerate(outs):
                r = self.ranks[shard][g.slot]
                if r == 0:
                    continue
                if xg is None:
                    xg = x.index_select(0, g.rows).float()  # [n, in]
                delta = (xg @ self.a[shard][g.slot, :r].t()) @ self.bt[shard][g.slot, :r]
                out.index_add_(0, g.rows, delta.to(out.dtype))  # [n, out] into its rows
        return y

    def extra_repr(self) -> str:
        return f"slots={len(self.ranks[0])}, max_rank={self.a[0].shape[1]}"
