"""Gemma 2's departures from the Llama decoder (config.GemmaConfig), read from a config.json or
from a GGUF's `gemma2.*` keys, every value checked by its field name."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import GemmaConfig
from pagedllm.loader.arch_values import positive_float
from pagedllm.loader.errors import ModelFileError

GEMMA_ARCHITECTURES = ("gemma2",)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh GeLU
_LAYER_TYPES = ("sliding_attention", "full_attention")
# llama.cpp scales Gemma 2 27B's queries by (hidden / heads) ** -0.5, the others' by
# head_dim ** -0.5 (its GGUF has no query_pre_attn_scalar); 27B is told by its layer count
_LAYERS_27B = 46


def _optional_cap(value: Any, key: str, source: str | Path) -> Optional[float]:
    return None if value is None else positive_float(value, key, source)


def _sliding_layers(cfg: Mapping[str, Any], num_layers: int, source: str | Path
                    ) -> tuple[int, ...]:
    """Indices of the sliding-window layers: layer_types, or else every other layer from the
    first, as transformers fills layer_types for Gemma 2."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(range(0, num_layers, 2))
    if not isinstance(types, list) or len(types) != num_layers or any(
            t not in _LAYER_TYPES for t in types):
        raise ModelFileError(f"layer_types must list one of {', '.join(_LAYER_TYPES)} for each "
                             f"of the {num_layers} layers, got {types!r} in {source}")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def gemma_from_hf(cfg: Mapping[str, Any], arch: str, num_layers: int,
                  source: str | Path) -> Optional[GemmaConfig]:
    """The Gemma fields of a config.json (None for another family)."""
    if arch not in GEMMA_ARCHITECTURES:
        return None
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ModelFileError(f"hidden_activation={act!r} is not supported (Gemma runs "
                             f"{' or '.join(_GELU_TANH)}) in {source}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelFileError(f"use_bidirectional_attention=true is not supported (pagedllm runs "
                             f"causal decoders) in {source}")
    return GemmaConfig(
        query_pre_attn_scalar=positive_float(cfg.get("query_pre_attn_scalar", 256),
                                             "query_pre_attn_scalar", source),
        sliding_layers=_sliding_layers(cfg, num_layers, source),
        attn_logit_softcapping=_optional_cap(cfg.get("attn_logit_softcapping"),
                                             "attn_logit_softcapping", source),
        final_logit_softcapping=_optional_cap(cfg.get("final_logit_softcapping"),
                                              "final_logit_softcapping", source))


def gemma_from_gguf(fields: Mapping[str, Any], p: str, num_layers: int, hidden: int, heads: int,
                    head_dim: int, source: str | Path) -> Optional[GemmaConfig]:
    """The Gemma fields of a GGUF (None for another family), with llama.cpp's defaults for
    the keys its converter may leave out: soft-caps 50 and 30, even layers sliding."""
    if p not in GEMMA_ARCHITECTURES:
        return None
    attn_key, final_key = f"{p}.attn_logit_softcapping", f"{p}.final_logit_softcapping"
    scalar = hidden / heads if num_layers == _LAYERS_27B else head_dim
    return GemmaConfig(
        query_pre_attn_scalar=float(scalar),
        sliding_layers=tuple(range(0, num_layers, 2)),
        attn_logit_softcapping=positive_float(fields.get(attn_key, 50.0), attn_key, source),
        final_logit_softcapping=positive_float(fields.get(final_key, 30.0), final_key, source))


def gemma_window(value: Any, gemma: Optional[GemmaConfig], key: str,
                 source: str | Path) -> None:
    """A ModelFileError naming key when a Gemma model has sliding layers but no window."""
    if gemma is not None and gemma.sliding_layers and value in (None, 0):
        raise ModelFileError(f"{key} is missing: Gemma's sliding-window layers need it "
                             f"({source})")
