"""LoRA on top of a linear layer, per token: swapped in from outside, as quantization is, so
the model code knows nothing of it.

A LoRALinear holds its base module (dense, GGUF blocks, or merged q/k/v or gate/up shards:
the base stays as it was loaded, quantized or not) and, per shard, max_loras slots of float32
matrices. A step's tokens come in groups, one per adapter slot (vLLM's punica idea: two small
matmuls per group, on top of the base output); tokens of no adapter are in no group:

    y_shard[rows] += (x[rows] @ A[slot, :r]^T) @ Bt[slot, :r]      Bt = scale * B^T  [r, out]

The step's adapter rows are gathered once per layer, group after group (each group a range
there), and each shard's deltas scatter-added once; every group's matmuls have the shapes they
would have with the group alone in the step, so a mixed batch changes no request's bits.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class LoRAGroup:
    """The step's token rows that run the adapter in one slot."""

    slot: int
    rows: torch.Tensor  # [n] int64, rows of the step's flattened tokens


@dataclass(frozen=True)
class _StepRows:
    """Every group's rows, group after group, and each group's (slot, first, count) there."""

    rows: torch.Tensor  # [n] int64
    ranges: tuple[tuple[int, int, int], ...]


_step_rows: ContextVar[Optional[_StepRows]] = ContextVar("lora_rows", default=None)


@contextmanager
def set_lora_groups(groups: tuple[LoRAGroup, ...]) -> Iterator[None]:
    """LoRALinear layers called inside add the deltas of these groups."""
    ranges, first = [], 0
    for g in groups:
        ranges.append((g.slot, first, g.rows.shape[0]))
        first += g.rows.shape[0]
    token = _step_rows.set(_StepRows(torch.cat([g.rows for g in groups]), tuple(ranges))
                           if groups else None)
    try:
        yield
    finally:
        _step_rows.reset(token)


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
    """base(x) plus each token group's LoRA delta, per output shard: per group one shrink
    matmul for every shard (their A stacked) and one expand matmul per shard."""

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
        # per slot and shard, what forward reads: scale B^T [:r] (None: the shard is left alone)
        self._bt: list[list[Optional[torch.Tensor]]] = [[None] * len(shard_sizes)
                                                        for _ in range(max_loras)]

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
        self._bt[slot] = [self.bt[i][slot, :ranks[slot]] if ranks[slot] else None
                          for i, ranks in enumerate(self.ranks)]

    def forward(self, x: torch.Tensor):
        """x [T, in] -> the base's output (a tensor, or a tuple of shard views), deltas added."""
        y = self.base(x)
        step = _step_rows.get()
        if step is None:
            return y
        outs = y if isinstance(y, tuple) else (y,)
        with _one_thread():
            xs = x.index_select(0, step.rows).float()  # [n, in], group after group
            h = xs.new_empty(xs.shape[0], self.a.shape[1])  # [n, shards x R]
            for slot, first, count in step.ranges:
                torch.mm(xs[first:first + count], self._at[slot], out=h[first:first + count])
            for i, out in enumerate(outs):
                parts = [(first, count, self._bt[slot][i]) for slot, first, count in step.ranges
                         if self._bt[slot][i] is not None]
                if not parts:
                    continue
                # rows of a group that leaves this shard alone add zeros
                new = xs.new_empty if len(parts) == len(step.ranges) else xs.new_zeros
                delta = new(xs.shape[0], out.shape[1])
                col = i * self.max_rank
                for first, count, bt in parts:
                    torch.mm(h[first:first + count, col:col + bt.shape[0]], bt,
                             out=delta[first:first + count])
                out.index_put_((step.rows,), delta.to(out.dtype), accumulate=True)
        return y

    def extra_repr(self) -> str:
        return f"slots={len(self.ranks[0])}, max_rank={self.max_rank}"
