"""The residual stream between pipeline stages, over torch.distributed point-to-point (gloo on
the CPU). Every stage sees the same SchedulerOutput, so the receiver knows how many tokens come
and no shape needs to travel: one tensor [2, T, H] a step, the layer output and the residual."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.stage import PipelineStage
from pagedllm.models.pipeline import IntermediateTensors


def send_to_next(stage: PipelineStage, stream: IntermediateTensors) -> None:
    """Send a stage's output to the next stage (blocks until it is taken)."""
    # float32 holds a bf16/fp16 layer output exactly, so one tensor carries both
    packed = torch.stack([stream.hidden.float(), stream.residual.float()])  # [2, T, H]
    dist.send(packed.cpu(), dst=stage.rank + 1)


def recv_from_prev(stage: PipelineStage, num_tokens: int, hidden_size: int,
                   dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
    """The previous stage's output for a step of num_tokens tokens; the layer output back in
    the model's dtype, the residual in float32 (as the layer loop keeps them)."""
    packed = torch.empty(2, num_tokens, hidden_size, dtype=torch.float32)
    dist.recv(packed, src=stage.rank - 1)
    packed = packed.to(device)
    return IntermediateTensors(packed[0].to(dtype), packed[1])
