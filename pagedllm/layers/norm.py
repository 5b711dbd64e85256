"""RMSNorm as Llama and Qwen2 define it (normalise in float32, scale in the model dtype), and
Gemma's (1 + w) variant."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from pagedllm.layers.custom_op import CustomOp

NormOut = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class _ResidualRMSNorm(CustomOp):
    """An RMSNorm with a learned scale (subclasses say how it applies: _norm); optionally adds a
    residual first and returns (norm(x + residual), x + residual)."""

    weight_init = 1.0  # the scale's value before loading: the identity

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), self.weight_init))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOut:
        """norm(x) [T, H] in the weight's dtype (and the summed residual when one is given)."""
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(_ResidualRMSNorm):
    """Root-mean-square layer norm with a learned scale; optionally adds a residual first.

    With a residual, returns (norm(x + residual), x + residual): the residual stream is summed
    by the next norm, in one fused op on the CPU.
    """

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOut:
        """The same in one C++ pass over float32 rows; with a residual, both in place."""
        if residual is None:
            return torch.ops.pagedllm.rms_norm(x, self.weight, self.eps)
        torch.ops.pagedllm.add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual  # x now holds the norm, residual the sum

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(self.weight.dtype)


class GemmaRMSNorm(_ResidualRMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, then casts (Llama casts first)."""

    weight_init = 0.0  # 1 + 0: the identity

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOut:
        """RMSNorm's C++ ops over the scale 1 + weight, added here on each call: the captured
        decode step adds it once at capture and calls the same ops, so both give the same
        numbers."""
        w = self.weight + 1.0
        if residual is None:
            return torch.ops.pagedllm.rms_norm(x, w, self.eps)
        torch.ops.pagedllm.add_rms_norm_(x, residual, w, self.eps)
        return x, residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(self.weight.dtype)
