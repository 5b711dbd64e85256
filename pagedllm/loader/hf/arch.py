"""Translate a Hugging Face config.json dict into a ModelArchConfig."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ClassifierConfig, ModelArchConfig, MoEConfig
from pagedllm.loader.arch_values import dimension, make_arch, positive_float, token_id
from pagedllm.loader.hf.encoder_arch import encoder_from_hf
from pagedllm.loader.hf.head_arch import classifier_from_hf, matryoshka
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gemma_arch import gemma3_global_rope, gemma_from_hf, gemma_window
from pagedllm.loader.window_layers import full_attention_layers

# HF model class name (config.json "architectures") -> registry key.
HF_ARCHITECTURES: dict[str, str] = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert_classifier",  # a cross-encoder or a classifier
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    # a decoder with a classification head over its last token (Qwen3-Reranker through vLLM's
    # hf_overrides, or a checkpoint converted to one: score.weight)
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "SmolLM3ForCausalLM": "smollm3",
    "XLMRobertaModel": "xlm_roberta",  # bge-m3's shape
    "XLMRobertaForSequenceClassification": "xlm_roberta_classifier",  # bge-reranker-v2-m3's
}

# config.json "model_type" -> registry key, used when "architectures" is absent.
_MODEL_TYPES: dict[str, str] = {"bert": "bert", "gemma2": "gemma2", "gemma3_text": "gemma3", "llama": "llama",
                                "mistral": "llama", "phi3": "phi3", "qwen2": "qwen2",
                                "qwen2_moe": "qwen2_moe", "qwen3": "qwen3",
                                "qwen3_moe": "qwen3_moe", "smollm3": "smollm3",
                                "xlm-roberta": "xlm_roberta"}
# Multimodal checkpoints (architecture, model_type) whose text decoder alone is supported
_TEXT_ONLY: dict[str, tuple[str, str]] = {
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM (model_type gemma3_text)")}
# Families whose sliding_window applies only with use_sliding_window
_WINDOW_SWITCHED = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")


def architecture_key(cfg: Mapping[str, Any], source: str | Path = "config.json") -> str:
    """Registry key for a config dict, or ModelFileError naming what is supported."""
    names = cfg.get("architectures") or []
    names = names if isinstance(names, list) else [names]
    for name in names:
        if isinstance(name, str) and name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    for name, (mm_type, text) in _TEXT_ONLY.items():
        if name in names or (not names and model_type == mm_type):
            raise ModelFileError(f"{name} (model_type {mm_type!r}) is a multimodal checkpoint; "
                                 f"only the text model is supported: {text} in {source}")
    if not names and isinstance(model_type, str) and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ModelFileError(
        f"architectures={names!r} (model_type={model_type!r}) is not supported; supported: "
        f"{', '.join(sorted(HF_ARCHITECTURES))} (model_type {', '.join(sorted(_MODEL_TYPES))}) "
        f"in {source}")


def _classifier(cfg: Mapping[str, Any], arch: str, source: str | Path
                ) -> Optional[ClassifierConfig]:
    """The classification head of a *ForSequenceClassification checkpoint, else None."""
    names = cfg.get("architectures") or []
    names = names if isinstance(names, list) else [names]
    if not any(isinstance(n, str) and n.endswith("ForSequenceClassification") for n in names):
        return None
    return classifier_from_hf(cfg, arch, source)


def _required(cfg: Mapping[str, Any], key: str, source: str | Path) -> Any:
    """cfg[key], or a ModelFileError naming the missing field."""
    if cfg.get(key) is None:
        raise ModelFileError(f"config.json has no {key!r} ({source})")
    return cfg[key]


def _rotary_dim(cfg: Mapping[str, Any], head_dim: int, source: str | Path) -> Optional[int]:
    """The values of each head RoPE turns when partial_rotary_factor (top level, or in
    rope_parameters as transformers 5 writes it) is below 1, as int(head_dim * factor) the way
    transformers computes it; None for the whole head."""
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    factor = cfg.get("partial_rotary_factor", factor)
    if factor is None or factor == 1:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
        raise ModelFileError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r} "
                             f"in {source}")
    return int(head_dim * factor)


def _rope(cfg: Mapping[str, Any], arch: str,
          source: str | Path) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) from either the legacy keys or transformers 5 `rope_parameters`
    (Gemma 3: its global layers'; its local ones' base is in config.gemma)."""
    if arch == "gemma3":
        cfg = gemma3_global_rope(cfg)
    params = dict(cfg.get("rope_parameters") or {})
    nested_theta = params.pop("rope_theta", None)
    params.pop("partial_rotary_factor", None)  # _rotary_dim
    theta = cfg.get("rope_theta", nested_theta)
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise ModelFileError(f"rope_scaling must be an object, got {scaling!r} in {source}")
        scaling = dict(scaling)
        scaling.pop("partial_rotary_factor", None)  # _rotary_dim
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling["type"]  # legacy spelling
        if arch == "phi3":
            _phi3_longrope(cfg, scaling)
        if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type", "type"}:
            scaling = None  # transformers 5 writes {"rope_type": "default"} for plain RoPE
        elif scaling.get("factor") is not None:
            positive_float(scaling["factor"], "rope_scaling.factor", source)
    return positive_float(10000.0 if theta is None else theta, "rope_theta", source), scaling


def _phi3_longrope(cfg: Mapping[str, Any], scaling: dict[str, Any]) -> None:
    """Phi-3's spellings of LongRoPE, as transformers reads them: types "su" and "yarn" are
    LongRoPE, and a top-level original_max_position_embeddings wins."""
    if scaling.get("rope_type") in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") == "longrope" and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]


def _sliding_window(cfg: Mapping[str, Any], arch: str, source: str | Path) -> Optional[int]:
    """The attention window, or None for full attention. Qwen2/Qwen3/SmolLM3 configs carry a
    sliding_window that applies only with use_sliding_window; null or 0 means none."""
    value = cfg.get("sliding_window")
    if arch in _WINDOW_SWITCHED and not cfg.get("use_sliding_window", False):
        return None
    return None if value in (None, 0) else dimension(value, "sliding_window", source)


def _nope_layers(cfg: Mapping[str, Any], arch: str, num_layers: int,
                 source: str | Path) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE, as transformers reads them: no_rope_layers[i] is 1 where
    layer i turns q and k and 0 where it does not; absent, every no_rope_layer_interval-th
    layer (4) is NoPE. () for other families."""
    if arch != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        step = dimension(cfg.get("no_rope_layer_interval", 4), "no_rope_layer_interval", source)
        return tuple(i for i in range(num_layers) if (i + 1) % step == 0)
    if (not isinstance(flags, list) or len(flags) < num_layers
            or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
        raise ModelFileError(f"no_rope_layers must be a list of 0/1 flags, one per layer "
                             f"({num_layers}), got {flags!r} in {source}")
    return tuple(i for i in range(num_layers) if not flags[i])


def _attention_bias(cfg: Mapping[str, Any], arch: str) -> bool:
    """Whether q/k/v have biases: always for Qwen2 (its config has no switch), Qwen2-MoE's
    qkv_bias (True when absent or null, as transformers defaults it), else attention_bias."""
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":
        return cfg.get("qkv_bias") is not False
    return bool(cfg.get("attention_bias", False))


def _moe(cfg: Mapping[str, Any], arch: str, num_layers: int,
         source: str | Path) -> Optional[MoEConfig]:
    """The routed experts of a Qwen MoE config (None for a dense family): a layer is sparse
    unless it is in mlp_only_layers or (index + 1) is not a multiple of decoder_sparse_step,
    as transformers decides."""
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return None

    def dim(key: str) -> int:
        return dimension(_required(cfg, key, source), key, source)

    step = dimension(cfg.get("decoder_sparse_step") or 1, "decoder_sparse_step", source)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise ModelFileError(f"mlp_only_layers must be a list of layer indices, got {only!r} in "
                             f"{source}")
    only = {token_id(i, "mlp_only_layers", source) for i in only}
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    shared = dim("shared_expert_intermediate_size") if arch == "qwen2_moe" else None
    try:
        return MoEConfig(
            num_experts=dimension(experts, "num_experts", source),
            num_experts_per_tok=dim("num_experts_per_tok"),
            moe_intermediate_size=dim("moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared, dense_layers=dense)
    except ValueError as err:
        raise ModelFileError(f"{err} in {source}") from None


def _eos_ids(value: Any, source: str | Path) -> tuple[int, ...]:
    """eos_token_id as written (None, int or list) -> tuple of ids."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(token_id(v, "eos_token_id", source) for v in values)


def arch_from_hf_config(cfg: Mapping[str, Any], source: str | Path = "config.json") -> ModelArchConfig:
    """ModelArchConfig from a parsed config.json (source: its path, for error messages)."""
    arch = architecture_key(cfg, source)

    def dim(key: str, default: Optional[int] = None) -> int:
        if cfg.get(key) is None and default is not None:
            return default
        return dimension(_required(cfg, key, source), key, source)

    hidden, heads = dim("hidden_size"), dim("num_attention_heads")
    head_dim = dim("head_dim", hidden // heads)
    rope_theta, rope_scaling = _rope(cfg, arch, source)
    gemma = gemma_from_hf(cfg, arch, dim("num_hidden_layers"), source)
    gemma_window(cfg.get("sliding_window"), gemma, "sliding_window", source)
    window, layers = _sliding_window(cfg, arch, source), dim("num_hidden_layers")
    nope = _nope_layers(cfg, arch, layers, source)
    bos = cfg.get("bos_token_id")
    matryoshka_dims, is_matryoshka = matryoshka(cfg, source)
    torch_dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    if torch_dtype is not None and not isinstance(torch_dtype, str):
        raise ModelFileError(f"torch_dtype must be a dtype name such as 'bfloat16', got "
                             f"{torch_dtype!r} in {source}")
    return make_arch(
        source,
        architecture=arch,
        vocab_size=dim("vocab_size"),
        hidden_size=hidden,
        intermediate_size=dim("intermediate_size"),
        num_hidden_layers=dim("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=dim("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope_theta=rope_theta,
        max_position_embeddings=dim("max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=_attention_bias(cfg, arch),
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else token_id(bos, "bos_token_id", source),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), source),
        torch_dtype=torch_dtype,
        qk_norm=arch in ("gemma3", "qwen3", "qwen3_moe"),
        sliding_window=window,
        full_attention_layers=(() if gemma is not None else
                               full_attention_layers(cfg, arch, layers, window, nope, source)),
        rotary_dim=_rotary_dim(cfg, head_dim, source),
        nope_layers=nope,
        moe=_moe(cfg, arch, dim("num_hidden_layers"), source),
        gemma=gemma,
        encoder=encoder_from_hf(cfg, arch, source),
        classifier=_classifier(cfg, arch, source),
        matryoshka_dimensions=matryoshka_dims,
        is_matryoshka=is_matryoshka,
    )
