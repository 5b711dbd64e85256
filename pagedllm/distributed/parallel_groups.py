"""Where each rank sits when tensor and pipeline parallelism are combined (vLLM's layout), and
the process group its tensor-parallel collectives run over.

    tp=2, pp=2: global rank = pp_rank * tp + tp_rank

                 TP rank 0   TP rank 1
    stage 0      rank 0      rank 1       <- TP group [0, 1]
    stage 1      rank 2      rank 3       <- TP group [2, 3]; rank 2 samples (the driver)
                   |            |
                 PP peers: (stage s, TP t) sends to (stage s + 1, TP t)

The default (world) group holds every rank: stage-to-stage send/recv use it with global ranks.
Each stage's TP ranks also form a group of their own, made with dist.new_group, which every
rank of the world must call for every group, in the same order. With one stage the TP group
is the whole world, and the default group serves (no group is made).

The group is held here, once per process, like torch.distributed's own default group: the
collectives deep in the model's layers (distributed/tensor_parallel.py) read it, and threading
it through every layer's constructor would put tensor parallelism into the model's code.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

_TP_GROUP: Optional[dist.ProcessGroup] = None  # None: the default group (all ranks are TP)


def global_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The rank in the world group of stage pp_rank's TP rank tp_rank."""
    return pp_rank * tp_size + tp_rank


def tp_group_ranks(pp_rank: int, tp_size: int) -> list[int]:
    """The global ranks of stage pp_rank's tensor-parallel group, in TP rank order."""
    return [global_rank(pp_rank, t, tp_size) for t in range(tp_size)]


def driver_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples, whose output the executor returns: TP rank 0 of the last stage."""
    return global_rank(pp_size - 1, 0, tp_size)


def init_tp_group(rank: int, tp_size: int, pp_size: int) -> None:
    """Make every stage's TP group (a collective call: all ranks, in the same order) and keep
    this rank's; nothing to make with one stage or one TP rank. Call once, after
    dist.init_process_group."""
    global _TP_GROUP
    if tp_size == 1 or pp_size == 1:
        _TP_GROUP = None
        return
    for pp_rank in range(pp_size):
        group = dist.new_group(tp_group_ranks(pp_rank, tp_size))
        if rank // tp_size == pp_rank:
            _TP_GROUP = group


def tp_group() -> Optional[dist.ProcessGroup]:
    """This rank's tensor-parallel group; None: the default group."""
    return _TP_GROUP
