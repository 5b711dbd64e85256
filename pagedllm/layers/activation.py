"""SwiGLU gate: silu(gate) * up."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SiluAndMul(nn.Module):
    """silu(gate) * up for two tensors of the same shape."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).mul_(up)
