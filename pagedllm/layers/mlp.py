"""Gated feed-forward: SwiGLU, the dense MLP of most families here and each expert of a MoE
layer, or GeGLU (Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up merged into one matmul; act is silu, or
    gelu_tanh with gelu=True."""

    def __init__(self, hidden_size: int, intermediate_size: int, gelu: bool = False) -> None:
        super().__init__()
        i = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, (i, i), ("gate_proj", "up_proj"), bias=False)
        self.down_proj = nn.Linear(i, hidden_size, bias=False)
        self.act = GeluTanhAndMul() if gelu else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(*self.gate_up_proj(x)))
