"""Gemma 2/3's departures from the Llama decoder (config.GemmaConfig), read from a config.json
or from a GGUF's `gemma2.*` / `gemma3.*` keys, every value checked by its field name."""
from __future__ import annotations

from collections import ChainMap
from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import GemmaConfig
from pagedllm.loader.arch_values import dimension, positive_float
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.window_layers import sliding_from_layer_types

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh GeLU
# llama.cpp scales Gemma 2/3 27B's queries by (hidden / heads) ** -0.5, the others' by
# head_dim ** -0.5 (its GGUF has no query_pre_attn_scalar); 27B is told by its layer count
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
# Gemma 3: five sliding layers, then a global one (transformers' and llama.cpp's default)
_GEMMA3_PATTERN = 6
# Gemma 3's default RoPE bases: global layers (rope_theta), local ones (rope_local_base_freq)
_GEMMA3_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0


def _optional_cap(value: Any, key: str, source: str | Path) -> Optional[float]:
    return None if value is None else positive_float(value, key, source)


def _sliding_layers(cfg: Mapping[str, Any], arch: str, num_layers: int, source: str | Path
                    ) -> tuple[int, ...]:
    """Indices of the sliding-window layers: layer_types, or else as transformers fills
    layer_types: every other layer from the first (Gemma 2), or all but every
    sliding_window_pattern-th (Gemma 3)."""
    types = cfg.get("layer_types")
    if types is None and arch == "gemma3":
        key = "sliding_window_pattern"
        pattern = dimension(cfg.get(key, _GEMMA3_PATTERN), key, source)
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if types is None:
        return tuple(range(0, num_layers, 2))
    return sliding_from_layer_types(types, num_layers, source)


def gemma3_global_rope(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """cfg with the global layers' RoPE at the top, as loader/hf/arch.py reads a one-table model:
    transformers 5 keys rope_parameters by layer type; older configs hold the global ones in
    rope_theta / rope_scaling. The base defaults to Gemma 3's 1e6. A view over cfg, not a copy:
    only the keys read are read (hf_overrides refuses the keys nothing reads)."""
    top: dict[str, Any] = {}
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        top["rope_parameters"] = params["full_attention"]
    view = ChainMap(top, cfg)
    if view.get("rope_theta") is None and (view.get("rope_parameters") or {}).get(
            "rope_theta") is None:
        top["rope_theta"] = _GEMMA3_THETA
    return view


def _local_rope_base(cfg: Mapping[str, Any], source: str | Path) -> float:
    """The sliding layers' RoPE base: rope_parameters["sliding_attention"] (transformers 5) or
    rope_local_base_freq; they run unscaled RoPE, as in transformers and llama.cpp."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if local is None:
        return positive_float(cfg.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA),
                              "rope_local_base_freq", source)
    key = "rope_parameters.sliding_attention"
    if not isinstance(local, Mapping) or local.get("rope_type", "default") != "default":
        raise ModelFileError(f"{key} must be plain RoPE (rope_type 'default'), got {local!r} in "
                             f"{source}")
    return positive_float(local.get("rope_theta", _GEMMA3_LOCAL_THETA), f"{key}.rope_theta",
                          source)


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
        sliding_layers=_sliding_layers(cfg, arch, num_layers, source),
        attn_logit_softcapping=_optional_cap(cfg.get("attn_logit_softcapping"),
                                             "attn_logit_softcapping", source),
        final_logit_softcapping=_optional_cap(cfg.get("final_logit_softcapping"),
                                              "final_logit_softcapping", source),
        rope_local_base_freq=_local_rope_base(cfg, source) if arch == "gemma3" else None)


def _gguf_sliding_layers(fields: Mapping[str, Any], p: str, num_layers: int,
                         source: str | Path) -> tuple[int, ...]:
    """Gemma 3's sliding layers as llama.cpp reads them: none without a window;
    <p>.attention.sliding_window_pattern as one flag per layer, or a period n (default 6)
    whose last layer is global."""
    if fields.get(f"{p}.attention.sliding_window") in (None, 0):
        return ()
    key = f"{p}.attention.sliding_window_pattern"
    value = fields.get(key, _GEMMA3_PATTERN)
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers or any(not isinstance(v, bool) for v in value):
            raise ModelFileError(f"{key} must hold one bool per layer ({num_layers}), got "
                                 f"{value!r} in {source}")
        return tuple(i for i, v in enumerate(value) if v)
    n = dimension(value, key, source)
    return tuple(i for i in range(num_layers) if i % n < n - 1)


def gemma_from_gguf(fields: Mapping[str, Any], p: str, num_layers: int, hidden: int, heads: int,
                    head_dim: int, source: str | Path) -> Optional[GemmaConfig]:
    """The Gemma fields of a GGUF (None for another family), with llama.cpp's defaults for
    the keys its converter may leave out: Gemma 2's soft-caps 50 and 30 and even layers
    sliding; Gemma 3 without soft-caps (its final one if set), local RoPE base 10000."""
    if p not in GEMMA_ARCHITECTURES:
        return None
    attn_key, final_key = f"{p}.attn_logit_softcapping", f"{p}.final_logit_softcapping"
    scalar = hidden / heads if num_layers == _LAYERS_27B[p] else head_dim
    if p == "gemma3":
        base_key = f"{p}.rope.freq_base_swa"
        return GemmaConfig(
            query_pre_attn_scalar=float(scalar),
            sliding_layers=_gguf_sliding_layers(fields, p, num_layers, source),
            final_logit_softcapping=_optional_cap(fields.get(final_key) or None, final_key,
                                                  source),
            rope_local_base_freq=positive_float(fields.get(base_key, _GEMMA3_LOCAL_THETA),
                                                base_key, source))
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
