"""SwiGLU gate: silu(gate) * up."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from pagedllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(gate) * up for two tensors of the same shape."""

    def forward_native(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up in PyTorch."""
        return F.silu(gate).mul_(up)

    def forward_cpu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """One fused C++ pass over float32 rows; the captured decode step calls the same op, so
        both give the same numbers."""
        return torch.ops.pagedllm.silu_mul(gate.contiguous(), up.contiguous())
