"""RMSNorm as Llama and Qwen2 define it (normalise in float32, scale in the model dtype)."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from pagedllm.kernels import kernels_loaded


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale; optionally adds a residual first."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x) [T, H] in the weight's dtype; with a residual, (norm(x + residual), x + residual)."""
        if _fused(x, self.weight, residual):
            if residual is None:
                return torch.ops.pagedllm.rms_norm(x, self.weight, self.eps)
            torch.ops.pagedllm.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual  # x now holds the norm, residual the sum (both in place)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(self.weight.dtype)


def _fused(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """The one-op CPU kernel applies: float32 CPU tensors, kernels loaded."""
    ok = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and kernels_loaded()
    return ok and x.is_contiguous() and (residual is None or (
        residual.dtype == torch.float32 and residual.is_contiguous()))
