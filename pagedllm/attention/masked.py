"""Attention with a sliding window (Gemma's local layers, Mistral, Qwen2/Qwen3 with
use_sliding_window, Phi-3) and soft-capped scores (Gemma 2), in plain PyTorch ops, as
transformers' eager attention computes it (its sdpa path builds the same mask): SDPA has no
soft-cap. Every backend sends the layers that need either through here (decided at build time);
the C++ decode kernel takes a window itself (attention/backends/cpu.py).

A query at position p sees the keys at positions k with p - window < k <= p:

    window 3, p = 5    keys  0 1 2 3 4 5 6
                             . . . x x x .
"""
from __future__ import annotations

from typing import Optional

import torch


def window_mask(q_pos: torch.Tensor, num_keys: int, window: Optional[int],
                first_key: int = 0) -> torch.Tensor:
    """[..., num_keys - first_key] bool, True = attend, for query positions q_pos [...] over
    keys at positions first_key..num_keys-1: causal, and within the window when one is given."""
    keys = torch.arange(first_key, num_keys, device=q_pos.device)
    mask = keys <= q_pos[..., None]
    if window is not None:
        mask &= keys > q_pos[..., None] - window
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: Optional[float]) -> torch.Tensor:
    """q [N, Hq, S, D] over k, v [N, Hkv, C, D] with mask broadcastable to [N, Hq, S, C]
    -> [N, Hq, S, D]; scores soft-capped (tanh(s / cap) * cap) before the mask when softcap is
    set, softmax in float32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [N, Hq, C, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [N, Hq, S, C]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
