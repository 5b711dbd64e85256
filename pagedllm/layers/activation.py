"""SwiGLU gate: silu(gate) * up."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.kernels import kernels_loaded


class SiluAndMul(nn.Module):
    """silu(gate) * up for two tensors of the same shape."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if (gate.device.type == "cpu" and gate.dtype == up.dtype == torch.float32
                and gate.is_contiguous() and up.is_contiguous() and kernels_loaded()):
            # one fused pass; the C++ decode step calls the same op, so both give the same numbers
            return torch.ops.pagedllm.silu_mul(gate, up)
        return F.silu(gate).mul_(up)
