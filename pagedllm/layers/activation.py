"""SwiGLU gate: silu(gate) * up."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SiluAndMul(nn.Module):
    """Takes [.., 2*I] (gate then up) and returns silu(gate) * up of shape [.., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
