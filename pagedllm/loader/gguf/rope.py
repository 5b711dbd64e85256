"""RoPE scaling that a GGUF stores as tensors rather than metadata -> the HF-style rope_scaling.

llama.cpp's converter writes no scaling type for either:
- Llama 3.1/3.2's "llama3" scaling becomes the tensor rope_freqs: one divisor per frequency
  (1 for the high ones, the factor for the low ones, a blend between).
- Phi-3's LongRoPE factor sets become rope_factors_long and rope_factors_short, with the
  original context length and the attention factor as metadata.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from pagedllm.config import ModelArchConfig
from pagedllm.loader.arch_values import dimension, positive_float
from pagedllm.loader.errors import ModelFileError

LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
FREQS = "rope_freqs.weight"
ROPE_FACTOR_TENSORS = frozenset({LONG, SHORT, FREQS})


def _factor_list(values: list[float], name: str, rotary_dim: int,
                 source: str | Path) -> list[float]:
    """One factor per rotated pair of values of a head, each a finite number > 0."""
    if len(values) != rotary_dim // 2:
        raise ModelFileError(f"tensor {name!r} has {len(values)} values, want one per rotated "
                             f"pair ({rotary_dim // 2}) in {source}")
    return [positive_float(v, name, source) for v in values]


def with_rope_factors(arch: ModelArchConfig, fields: Mapping[str, Any],
                      factors: Mapping[str, list[float]], source: str | Path) -> ModelArchConfig:
    """arch with rope_scaling made from the GGUF's factor tensors (name -> values)."""
    p = fields.get("general.architecture")
    if arch.rope_scaling is not None:
        raise ModelFileError(f"GGUF has both {p}.rope.scaling.* metadata and the tensor "
                             f"{' and '.join(sorted(factors))}: which RoPE scaling runs is "
                             f"ambiguous ({source})")
    if set(factors) == {FREQS}:
        divisors = _factor_list(factors[FREQS], FREQS, arch.rope_dim, source)
        return dataclasses.replace(arch, rope_scaling={"rope_type": "frequency_divisors",
                                                       "divisors": divisors})
    if set(factors) != {LONG, SHORT}:
        raise ModelFileError(f"GGUF has {', '.join(sorted(factors))} without "
                             f"{', '.join(sorted(ROPE_FACTOR_TENSORS - set(factors)))}: LongRoPE "
                             f"needs both factor sets ({source})")
    key = f"{p}.rope.scaling.original_context_length"
    if fields.get(key) is None:
        raise ModelFileError(f"GGUF has LongRoPE factors but no {key!r} in {source}")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": _factor_list(factors[LONG], LONG, arch.rope_dim, source),
        "short_factor": _factor_list(factors[SHORT], SHORT, arch.rope_dim, source),
        "original_max_position_embeddings": dimension(fields[key], key, source),
    }
    key = f"{p}.rope.scaling.attn_factor"
    if fields.get(key) is not None:
        scaling["attention_factor"] = positive_float(fields[key], key, source)
    return dataclasses.replace(arch, rope_scaling=scaling)
