"""Gated activations: SwiGLU silu(gate) * up, GeGLU gelu_tanh(gate) * up."""
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


class GeluTanhAndMul(CustomOp):
    """gelu_tanh(gate) * up (Gemma's GeGLU, transformers' gelu_pytorch_tanh)."""

    def forward_native(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, approximate="tanh") * up in PyTorch."""
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward_cpu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """One C++ pass over float32 rows, the op the captured decode step calls."""
        return torch.ops.pagedllm.gelu_tanh_mul(gate.contiguous(), up.contiguous())
