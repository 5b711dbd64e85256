"""Which layers of a windowed config.json attend over their whole context anyway, as each
transformers family fills its layer_types when the config names none:

    qwen2, qwen3    layers below max_window_layers (default 28) are full
    qwen2_moe       only even layers below max_window_layers slide
    smollm3         only its NoPE layers slide
    others          every layer slides (Mistral, Phi-3, Qwen3-MoE)

A config's own layer_types wins where the family reads it (all but Mistral, Phi-3, Qwen3-MoE).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from pagedllm.loader.arch_values import dimension
from pagedllm.loader.errors import ModelFileError

LAYER_TYPES = ("sliding_attention", "full_attention")
_QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default max_window_layers
# families whose attention reads layer_types (the others slide on every layer)
_READ_LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe", "smollm3")


def sliding_from_layer_types(types: Any, num_layers: int, source: str | Path) -> tuple[int, ...]:
    """The indices that layer_types names sliding_attention, checked: one known type a layer."""
    if not isinstance(types, list) or len(types) != num_layers or any(
            t not in LAYER_TYPES for t in types):
        raise ModelFileError(f"layer_types must list one of {', '.join(LAYER_TYPES)} for each "
                             f"of the {num_layers} layers, got {types!r} in {source}")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _family_sliding(cfg: Mapping[str, Any], arch: str, num_layers: int,
                    nope_layers: Sequence[int], source: str | Path) -> tuple[int, ...]:
    """The sliding layers by the family's rule, without layer_types."""
    if arch in ("qwen2", "qwen3", "qwen2_moe"):
        key = "max_window_layers"
        limit = cfg.get(key)
        if limit is None:
            limit = _QWEN_MAX_WINDOW_LAYERS
        elif limit != 0:  # 0: every layer may slide
            limit = dimension(limit, key, source)
        if arch == "qwen2_moe":
            return tuple(i for i in range(num_layers) if i % 2 == 0 and i < limit)
        return tuple(i for i in range(num_layers) if i >= limit)
    if arch == "smollm3":
        return tuple(nope_layers)
    return tuple(range(num_layers))


def full_attention_layers(cfg: Mapping[str, Any], arch: str, num_layers: int,
                          window: Optional[int], nope_layers: Sequence[int],
                          source: str | Path) -> tuple[int, ...]:
    """The layers that attend over their whole context though the config has a window; () when
    it has none (every layer is full then, by ModelArchConfig.layer_window)."""
    if window is None:
        return ()
    types = cfg.get("layer_types") if arch in _READ_LAYER_TYPES else None
    sliding = (_family_sliding(cfg, arch, num_layers, nope_layers, source) if types is None
               else sliding_from_layer_types(types, num_layers, source))
    return tuple(i for i in range(num_layers) if i not in sliding)
