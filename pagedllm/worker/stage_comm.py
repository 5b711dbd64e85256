"""The residual stream between pipeline stages, over torch.distributed point-to-point (gloo on
the CPU). Every stage sees the same SchedulerOutput, so the receiver knows how many tokens come
and no shape needs to travel: one tensor [2, T, H] a step, the layer output and the residual.

Each send and receive is timed (COMM_STATS, read by the executor's comm_stats call): a send
blocks until the next stage takes the tensor, so on the first stage it is the transfer; a
receive also waits for the stages before to compute, so it holds that wait too.

With tensor parallelism too, each TP rank of a stage sends to the same TP rank of the next
(global ranks, distributed/parallel_groups.py): after the all-reduce the stream is the same
on every TP rank, so each sends it whole and the next stage's ranks need no collective."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pagedllm.distributed.comm_stats import Counters
from pagedllm.distributed.parallel_groups import global_rank
from pagedllm.distributed.stage import PipelineStage
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.models.pipeline import IntermediateTensors


@dataclass
class CommStats(Counters):
    """Point-to-point traffic of this rank since it started (or since the last reset)."""

    sends: int = 0
    send_s: float = 0.0
    send_bytes: int = 0
    recvs: int = 0
    recv_s: float = 0.0
    recv_bytes: int = 0


COMM_STATS = CommStats()


def peer_rank(stage: PipelineStage, tp: Optional[TensorParallelRank], step: int) -> int:
    """The global rank of this rank's peer `step` stages on (+1: the next, -1: the one
    before): the same TP rank there."""
    tp_rank, tp_size = (0, 1) if tp is None else (tp.rank, tp.world_size)
    return global_rank(stage.rank + step, tp_rank, tp_size)


def send_to_next(stage: PipelineStage, stream: IntermediateTensors,
                 tp: Optional[TensorParallelRank] = None) -> None:
    """Send a stage's output to the next stage (its TP rank tp; blocks until it is taken)."""
    # float32 holds a bf16/fp16 layer output exactly, so one tensor carries both
    packed = torch.stack([stream.hidden.float(), stream.residual.float()]).cpu()  # [2, T, H]
    started = time.perf_counter()
    dist.send(packed, dst=peer_rank(stage, tp, +1))
    COMM_STATS.send_s += time.perf_counter() - started
    COMM_STATS.sends += 1
    COMM_STATS.send_bytes += packed.numel() * 4


def recv_from_prev(stage: PipelineStage, num_tokens: int, hidden_size: int,
                   dtype: torch.dtype, device: torch.device,
                   tp: Optional[TensorParallelRank] = None) -> IntermediateTensors:
    """The previous stage's output (from its TP rank tp) for a step of num_tokens tokens; the
    layer output back in the model's dtype, the residual in float32 (as the layer loop keeps
    them)."""
    packed = torch.empty(2, num_tokens, hidden_size, dtype=torch.float32)
    started = time.perf_counter()
    dist.recv(packed, src=peer_rank(stage, tp, -1))
    COMM_STATS.recv_s += time.perf_counter() - started
    COMM_STATS.recvs += 1
    COMM_STATS.recv_bytes += packed.numel() * 4
    packed = packed.to(device)
    return IntermediateTensors(packed[0].to(dtype), packed[1])
