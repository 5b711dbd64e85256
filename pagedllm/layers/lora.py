"""LoRA on top of a linear layer, per token: swapped in from outside, as quantization is, so
the model code knows nothing of it.

A LoRALinear holds its base module (dense, GGUF blocks, or merged q/k/v or gate/up shards:
the base stays as it was loaded, quantized or not) and, per shard, max_loras slots of float32
matrices. A step's tokens come in groups, one per adapter slot (vLLM's punica idea: two small
matmuls per group, on top of the base output); tokens of no adapter are in no group:

    y_shard[rows] += (x[rows] @ A[slot, :r]^T) @ Bt[slot, :r]      Bt = scale * B^T  [r, out]

With the C++ ops (float32 on the CPU: forward_cpu), every shard's delta is one call,
lora_add_ (kernels/csrc/lora_delta.cpp), which computes each row alone by its slot (the step's
slots, one per token row, -1 for none); the C++ decode stack calls the same op on the same slot
tensors (set_lora), so decode steps with adapters keep it and give the layer loop's numbers.

In plain PyTorch (forward_native) the step's adapter rows are gathered once per layer, group
after group (each group a range there), and each shard's deltas scatter-added once; every
group's matmuls have the shapes they would have with the group alone in the step. Either way a
mixed batch changes no request's bits.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from pagedllm.layers.custom_op import CustomOp


@dataclass(frozen=True)
class LoRAGroup:
    """The step's token rows that run the adapter in one slot."""

    slot: int
    rows: torch.Tensor  # [n] int64, rows of the step's flattened tokens


@dataclass(frozen=True)
class _StepRows:
    """Every group's rows, group after group, and each group's (slot, first, count) there;
    and each token row's slot (-1: none)."""

    rows: torch.Tensor  # [n] int64
    ranges: tuple[tuple[int, int, int], ...]
    slots: torch.Tensor  # [T] int64


_step_rows: ContextVar[Optional[_StepRows]] = ContextVar("lora_rows", default=None)


@contextmanager
def set_lora_groups(groups: tuple[LoRAGroup, ...], num_tokens: int) -> Iterator[None]:
    """LoRALinear layers called inside add the deltas of these groups to a step of num_tokens
    token rows."""
    step = None
    if groups:
        ranges, first = [], 0
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=groups[0].rows.device)
        for g in groups:
            ranges.append((g.slot, first, g.rows.shape[0]))
            first += g.rows.shape[0]
            slots[g.rows] = g.slot
        step = _StepRows(torch.cat([g.rows for g in groups]), tuple(ranges), slots)
    token = _step_rows.set(step)
    try:
        yield
    finally:
        _step_rows.reset(token)


def step_lora_slots() -> Optional[torch.Tensor]:
    """Each token row's slot in the current step (-1: none), or None when no row has one."""
    step = _step_rows.get()
    return None if step is None else step.slots


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


class LoRALinear(CustomOp):
    """base(x) plus each token group's LoRA delta, per output shard: one C++ call for every
    shard (forward_cpu), or per group one shrink matmul for every shard (their A stacked) and
    one expand matmul per shard (forward_native)."""

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
        # the same, [slot, shard], for lora_add_ (and the C++ decode stack, which holds it)
        self.rank_table = torch.zeros(max_loras, len(shard_sizes), dtype=torch.int64)
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
        self.rank_table[slot, shard] = r
        self._plan(slot)

    def clear_slot(self, slot: int) -> None:
        """The slot adds nothing to any shard until set again."""
        for ranks in self.ranks:
            ranks[slot] = 0
        self.rank_table[slot] = 0
        self._plan(slot)

    def _plan(self, slot: int) -> None:
        self._bt[slot] = [self.bt[i][slot, :ranks[slot]] if ranks[slot] else None
                          for i, ranks in enumerate(self.ranks)]

    def forward_cpu(self, x: torch.Tensor):
        """x [T, in] float32 -> the base's output, every shard's delta added in one C++ call."""
        y = self.base(x)
        step = _step_rows.get()
        if step is None:
            return y
        x = x if x.stride(-1) == 1 else x.contiguous()  # the op reads whole rows
        torch.ops.pagedllm.lora_add_(list(y) if isinstance(y, tuple) else [y], x, step.slots,
                                     self.a, self.bt, self.rank_table)
        return y

    def forward_native(self, x: torch.Tensor):
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
