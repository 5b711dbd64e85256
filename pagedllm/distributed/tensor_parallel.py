"""Tensor parallelism: which part of each sharded tensor a rank holds, and the two collectives
the model needs (vLLM's and Megatron's split).

    column-parallel (q/k/v, gate/up, embedding, head): a contiguous range of output rows
    row-parallel (o_proj, down_proj): a contiguous range of the reduction axis, every row

            x [T, H]                                     rank r of N
    q/k/v:  W [rows of r's heads, H]       -> local heads: attention runs on them alone
    o_proj: W [H, columns of r's heads]    -> partial sums [T, H] -> all_reduce -> [T, H]

The collectives run over this rank's TP group (distributed/parallel_groups.py): the default
torch.distributed group (gloo on the CPU) when every rank is a tensor rank, else its pipeline
stage's TP ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.comm_stats import TP_COMM_STATS
from pagedllm.distributed.parallel_groups import tp_group
from pagedllm.shard import Shard  # noqa: F401 - re-exported for the models' TP plans


@dataclass(frozen=True)
class TensorParallelRank:
    """This process's place among the tensor-parallel ranks."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank}")

    @property
    def is_driver(self) -> bool:
        """Samples the step's tokens (rank 0, as in vLLM); the others get them from it."""
        return self.rank == 0

    def split(self, total: int, what: str, unit: str = "rows") -> range:
        """This rank's contiguous range of `total` entries split evenly, or a ValueError naming
        `what` when they do not divide."""
        if total % self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size}: {what} has {total} "
                             f"{unit}, which do not split evenly over {self.world_size} ranks")
        size = total // self.world_size
        return range(self.rank * size, (self.rank + 1) * size)

    def split_blocks(self, total: int, block: int, what: str, unit: str = "values") -> range:
        """This rank's contiguous range of `total` entries, cut only where a `block` of them
        ends: the even split when its parts are whole blocks, else the blocks dealt out with
        the first ranks one more (19 blocks of 256 over 2 ranks: 2560 and 2304). A ValueError
        naming `what` when `total` is not whole blocks or they are fewer than the ranks."""
        blocks, rest = divmod(total, block)
        if rest or blocks < self.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.world_size}: {what} has {total} {unit}, "
                f"{total / block:g} blocks of {block}, which cannot be split at block "
                f"boundaries over {self.world_size} ranks (load it dequantized with "
                f"quantization='none', or use a smaller tensor_parallel_size)")
        base, extra = divmod(blocks, self.world_size)
        start = (self.rank * base + min(self.rank, extra)) * block
        return range(start, start + (base + (self.rank < extra)) * block)

    def kv_heads(self, num_kv_heads: int, what: str) -> range:
        """The KV heads this rank holds: its share when there are at least as many as ranks,
        else the one its query heads use (replicated on world_size / num_kv_heads ranks)."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads, what, "key/value heads")
        if self.world_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={self.world_size}: {what} has "
                             f"{num_kv_heads} key/value heads, which cannot be replicated "
                             f"evenly over {self.world_size} ranks")
        head = self.rank // (self.world_size // num_kv_heads)
        return range(head, head + 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the TP group's ranks of x, in place (x must be contiguous); timed
    (TP_COMM_STATS)."""
    started = time.perf_counter()
    dist.all_reduce(x, group=tp_group())
    TP_COMM_STATS.add_all_reduce(x.numel() * x.element_size(), started)
    return x


def all_gather_last(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """[..., n] on each TP rank -> [..., world_size * n], the ranks' parts in TP rank order;
    timed."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    started = time.perf_counter()
    dist.all_gather(parts, x.contiguous(), group=tp_group())
    TP_COMM_STATS.add_all_gather(x.numel() * x.element_size(), started)
    return torch.cat(parts, dim=-1)
