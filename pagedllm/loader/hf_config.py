"""Translate a Hugging Face config.json dict into a ModelArchConfig."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from pagedllm.config import ModelArchConfig

# HF model class name (config.json "architectures") -> registry key.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

# config.json "model_type" -> registry key, used when "architectures" is absent.
_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def architecture_key(cfg: Mapping[str, Any]) -> str:
    """Registry key for a config dict, or ValueError naming what is supported."""
    names = cfg.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if not names and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"architectures={names!r} (model_type={model_type!r}) is not supported; supported: "
        f"{', '.join(sorted(HF_ARCHITECTURES))} (model_type {', '.join(sorted(_MODEL_TYPES))})")


def _required(cfg: Mapping[str, Any], key: str) -> Any:
    """cfg[key], or a ValueError naming the missing field."""
    if cfg.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return cfg[key]


def _rope(cfg: Mapping[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) from either the legacy keys or transformers 5 `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    nested_theta = params.pop("rope_theta", None)
    theta = cfg.get("rope_theta", nested_theta)
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = dict(scaling)
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling["type"]  # legacy spelling
        if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type", "type"}:
            scaling = None  # transformers 5 writes {"rope_type": "default"} for plain RoPE
    return float(10000.0 if theta is None else theta), scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    """eos_token_id as written (None, int or list) -> tuple of ids."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def arch_from_hf_config(cfg: Mapping[str, Any]) -> ModelArchConfig:
    """ModelArchConfig from a parsed config.json."""
    arch = architecture_key(cfg)
    hidden = int(_required(cfg, "hidden_size"))
    heads = int(_required(cfg, "num_attention_heads"))
    rope_theta, rope_scaling = _rope(cfg)
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(_required(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_required(cfg, "intermediate_size")),
        num_hidden_layers=int(_required(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(_required(cfg, "max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; its config has no switch for them.
        attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )
