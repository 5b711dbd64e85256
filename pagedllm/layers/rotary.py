"""Rotary position embeddings (NeoX / HF rotate_half layout) with the scaling schemes configs use."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from pagedllm.layers.custom_op import CustomOp


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, s: dict[str, Any],
                   max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn_factor = _yarn_mscale(factor)

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(old_len / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor, attn_factor


def longrope_uses_long_factors(scaling: dict[str, Any], max_pos: int, context_len: int) -> bool:
    """Whether LongRoPE runs with its long factor set: when the engine's context is longer than
    the model's original one. Decided once for the whole table, as llama.cpp does: transformers
    switches per forward pass on the sequence's length, which a paged cache shared by many
    sequences (and their prefix-cached blocks) cannot follow, and which agrees with this for
    every sequence when the context and the sequences are on the same side of the original."""
    return context_len > (scaling.get("original_max_position_embeddings") or max_pos)


def rope_summary(scaling: Optional[dict[str, Any]], max_pos: int, context_len: int) -> str:
    """For the load log: which LongRoPE factor set runs and why, or "" for other RoPE."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind != "longrope":
        return ""
    old_len = scaling.get("original_max_position_embeddings") or max_pos
    if longrope_uses_long_factors(scaling, max_pos, context_len):
        return f"LongRoPE long factors (max_model_len {context_len} > original context {old_len})"
    return f"LongRoPE short factors (max_model_len {context_len} <= original context {old_len})"


def _longrope_inv_freq(base: float, dim: int, s: dict[str, Any], max_pos: int,
                       context_len: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its factor, from the long or short set."""
    old_len = s.get("original_max_position_embeddings") or max_pos
    key = "long_factor" if longrope_uses_long_factors(s, max_pos, context_len) else "short_factor"
    factors = torch.tensor(s[key], dtype=torch.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"rope_scaling.{key} has {factors.numel()} values, want {dim // 2} "
                         f"(one per rotated pair of the {dim} rotated values of a head)")
    factor = s.get("factor") or max_pos / old_len
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        attn_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base ** shape), attn_factor


def rope_inv_freq(base: float, dim: int, scaling: Optional[dict[str, Any]], max_pos: int,
                  context_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention scale factor for a rope_scaling config
    (max_pos: the model's max_position_embeddings; context_len: the positions the engine runs,
    max_pos when not given)."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return _default_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim) / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(_default_inv_freq(base, dim), scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(base, dim, scaling, max_pos)
    if kind == "longrope":
        return _longrope_inv_freq(base, dim, scaling, max_pos, context_len or max_pos)
    if kind == "frequency_divisors":  # a GGUF's rope_freqs tensor (loader/gguf/rope.py)
        return _default_inv_freq(base, dim) / torch.tensor(scaling["divisors"]), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: "
                     "none (default), linear, llama3, yarn, longrope")


class RotaryEmbedding(CustomOp):
    """Precomputed cos/sin tables indexed by absolute position; they turn the first rotary_dim
    values of each head (all of them but for partial-rotary models such as Phi-4-mini)."""

    def __init__(self, rotary_dim: int, max_positions: int, base: float,
                 scaling: Optional[dict[str, Any]] = None, model_max_positions: int = 0) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        model_max = model_max_positions or max_positions
        self._args = (rotary_dim, max_positions, base, scaling, model_max)
        self.reset_tables(None)

    def with_base(self, base: float) -> "RotaryEmbedding":
        """Tables of the same size over another base, unscaled (Gemma 3's sliding layers)."""
        rotary_dim, max_positions, _, _, model_max = self._args
        return RotaryEmbedding(rotary_dim, max_positions, base, None, model_max)

    def reset_tables(self, device: Optional[torch.device]) -> None:
        """(Re)compute the float32 cos/sin tables on device (None: the CPU), e.g. after building
        on the meta device."""
        rotary_dim, max_positions, base, scaling, model_max = self._args
        # computed on the CPU even inside a meta-device context: meta arithmetic goes through
        # Python decompositions that import torch._dynamo (seconds of start-up)
        with torch.device("cpu"):
            inv_freq, attn_scale = rope_inv_freq(base, rotary_dim, scaling, model_max,
                                                 max_positions)
            pos = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            cos, sin = emb.cos() * attn_scale, emb.sin() * attn_scale
        self.register_buffer("cos", cos.to(device or "cpu"), persistent=False)
        self.register_buffer("sin", sin.to(device or "cpu"), persistent=False)

    def forward_cpu(self, positions: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate float32 q and k in place in one C++ op (a merged projection's split views are
        strided, so they are made contiguous first)."""
        q, k = q.contiguous(), k.contiguous()
        torch.ops.pagedllm.rope_(q, k, positions, self.cos, self.sin)
        return q, k

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, R]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        if self.rotary_dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        r = self.rotary_dim  # the rest of each head passes through
        q_rot, k_rot = q[..., :r], k[..., :r]
        return (torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., r:]), dim=-1),
                torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., r:]), dim=-1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
