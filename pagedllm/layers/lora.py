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


@contextmanager
def _one_thread() -> Iterator[None]:
    """The deltas' small ops on this thread alone: split over threads, each op waits at a
    barrier for the others, which costs a scheduler time slice (milliseconds) whenever the
    machine is busy; alone they take microseconds."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LoRALinear(nn.Module):
    """base(x) plus each token group's LoRA delta, per output shard: one shrink matmul for
    every shard (their A stacked), then one expand matmul and one scatter-add per shard."""

    def __init__(self, base: nn.Module, in_features: int, shard_sizes: Sequence[int],
                 max_loras: int, max_rank: int, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.max_rank = max_rank
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
        # every shard's A per slot, stacked by rank: shard i is rows [i R, i R + R), zero past
        # the adapter's r (so the extra rows add exact zeros)
        self.a = zeros(max_loras, len(shard_sizes) * max_rank, in_features)
        self.bt = [zeros(max_loras, max_rank, n) for n in shard_sizes]  # scale * B^T per slot
        self.ranks = [[0] * max_loras for _ in shard_sizes]  # 0: the slot leaves the shard alone
        self._at = [self.a[slot].t() for slot in range(max_loras)]  # [in, shards x R] views
        # per slot, what forward reads: (shard, its first column of x A^T, scale B^T [:r])
        self._shards: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(max_loras)]

    def set_slot(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor,
                 scale: float) -> None:
        """Load one adapter's A [r, in] and B [out, r] for a shard into a slot."""
        r, first = a.shape[0], shard * self.max_rank
        self.a[slot, first:first + self.max_rank].zero_()
        self.a[slot, first:first + r].copy_(a)
        self.bt[shard][slot].zero_()
        self.bt[shard][slot, :r].copy_(b.t() * scale)
        self.ranks[shard][slot] = r
        self._plan(slot)

    def clear_slot(self, slot: int) -> None:
        """The slot adds nothing to any shard until set again."""
        for ranks in self.ranks:
            ranks[slot] = 0
        self._plan(slot)

    def _plan(self, slot: int) -> None:
        self._shards[slot] = [(i, i * self.max_rank, self.bt[i][slot, :ranks[slot]])
                              for i, ranks in enumerate(self.ranks) if ranks[slot]]

    def forward(self, x: torch.Tensor):
        """x [T, in] -> the base's output (a tensor, or a tuple of shard views), deltas added."""
        y = self.base(x)
        groups = _step_groups.get()
        if not groups:
            return y
        outs = y if isinstance(y, tuple) else (y,)
        with _one_thread():
            for g in groups:
                shards = self._shards[g.slot]
                if not shards:
                    continue
                h = x.index_select(0, g.rows).float() @ self._at[g.slot]  # [n, shards x R]
                for i, first, bt in shards:
                    delta = h[:, first:first + bt.shape[0]] @ bt  # [n, out]
                    outs[i].index_put_((g.rows,), delta.to(outs[i].dtype), accumulate=True)
        return y

    def extra_repr(self) -> str:
        return f"slots={len(self.ranks[0])}, max_rank={self.max_rank}"
