"""The Attention layer: paged attention through the backend the platform chose at build time."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.metadata import get_forward_metadata
from pagedllm.layers.custom_op import current_build_context


class Attention(nn.Module):
    """Writes this step's K/V into its layer's paged cache and attends over each request's
    context; the cache is bound by the model runner (bind_kv_cache), the step's metadata comes
    from the forward context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, softcap: Optional[float] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # keys within the last sliding_window positions; (Gemma 2) scores -> tanh(s / cap) * cap
        self.sliding_window, self.softcap = sliding_window, softcap
        self.backend = current_build_context().attn_backend
        self.impl = self.backend.impl_cls(scale, sliding_window, softcap)
        self.kv_cache: Optional[torch.Tensor] = None  # [2, NB, BS, Hkv, D] once bound

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""
        if self.kv_cache is None:
            raise RuntimeError("Attention has no KV cache: the runner binds one before a step")
        return self.impl.forward(q, k, v, self.kv_cache, get_forward_metadata())

    def extra_repr(self) -> str:
        extra = "" if self.sliding_window is None else f", window={self.sliding_window}"
        extra += "" if self.softcap is None else f", softcap={self.softcap}"
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim},"
                f" backend={self.backend.name}{extra}")


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor) -> int:
    """Give the model's Attention layers, in order, their slices of the whole cache
    [layers, 2, NB, BS, Hkv, D]; returns how many were bound."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != kv_cache.shape[0]:
        raise ValueError(f"the KV cache has {kv_cache.shape[0]} layers, the model "
                         f"{len(layers)} Attention layers")
    for layer, cache in zip(layers, kv_cache):
        layer.kv_cache = cache
    return len(layers)
