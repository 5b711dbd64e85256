"""A GGUF's metadata and tensor table -> ModelArchConfig, every number checked by key name."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ModelArchConfig
from pagedllm.loader.arch_values import dimension, make_arch, positive_float, token_id
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf_header import GGUFTensorInfo

# GGUF general.architecture -> registry key (llama.cpp stores Mistral as "llama").
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "phi3": "phi3", "qwen2": "qwen2",
                                      "qwen3": "qwen3"}


def _required(fields: Mapping[str, Any], key: str, source: str | Path) -> Any:
    """Metadata value, or a ModelFileError naming the missing key."""
    if fields.get(key) is None:
        raise ModelFileError(f"GGUF metadata has no {key!r} in {source}")
    return fields[key]


def _rope_scaling(fields: Mapping[str, Any], prefix: str, source: str | Path
                  ) -> Optional[dict[str, Any]]:
    """HF-style rope_scaling dict from `<arch>.rope.scaling.*` (or legacy scale_linear) keys."""
    factor_key = f"{prefix}.rope.scaling.factor"
    kind, factor = fields.get(f"{prefix}.rope.scaling.type"), fields.get(factor_key)
    if kind is None and (linear := fields.get(f"{prefix}.rope.scale_linear")) is not None:
        kind, factor, factor_key = "linear", linear, f"{prefix}.rope.scale_linear"
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = positive_float(factor, factor_key, source)
    key = f"{prefix}.rope.scaling.original_context_length"
    if fields.get(key) is not None:
        scaling["original_max_position_embeddings"] = dimension(fields[key], key, source)
    key = f"{prefix}.rope.scaling.attn_factor"
    if fields.get(key) is not None:
        scaling["attention_factor"] = positive_float(fields[key], key, source)
    return scaling


def _eos_ids(fields: Mapping[str, Any], source: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids: eos, then end-of-turn / end-of-message if the GGUF names them."""
    ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        key = f"tokenizer.ggml.{name}"
        if fields.get(key) is not None and (value := token_id(fields[key], key, source)) not in ids:
            ids.append(value)
    return tuple(ids)


def _embedding(tensors: tuple[GGUFTensorInfo, ...], hidden: int, key: str,
               source: str | Path) -> GGUFTensorInfo:
    """token_embd.weight, which must be [vocab, hidden]."""
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelFileError(f"GGUF has no tensor 'token_embd.weight' in {source}")
    if len(embed.shape) != 2 or embed.shape[1] != hidden:
        raise ModelFileError(f"{key}={hidden} but tensor 'token_embd.weight' has shape "
                             f"{embed.shape} (want [vocab, {hidden}]) in {source}")
    return embed


def arch_from_header(fields: Mapping[str, Any], tensors: tuple[GGUFTensorInfo, ...],
                     source: str | Path) -> ModelArchConfig:
    """ModelArchConfig from the `<arch>.*` keys and the tensor table of the GGUF at source."""
    p = _required(fields, "general.architecture", source)
    if p not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"general.architecture={p!r} is not supported; "
                             f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))} (in {source})")

    def dim(key: str, default: Optional[int] = None) -> int:
        value = fields.get(f"{p}.{key}")
        if value is None and default is not None:
            return default
        return dimension(_required(fields, f"{p}.{key}", source), f"{p}.{key}", source)

    hidden, heads = dim("embedding_length"), dim("attention.head_count")
    embed = _embedding(tensors, hidden, f"{p}.embedding_length", source)
    head_dim = dim("attention.key_length", hidden // heads)
    rotary_dim = dim("rope.dimension_count", head_dim)
    names = {t.name for t in tensors}
    eps_key, theta_key = f"{p}.attention.layer_norm_rms_epsilon", f"{p}.rope.freq_base"
    bos = fields.get("tokenizer.ggml.bos_token_id")
    window = fields.get(f"{p}.attention.sliding_window")  # 0: none (how llama.cpp writes it)
    return make_arch(
        source,
        architecture=GGUF_ARCHITECTURES[p],
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        intermediate_size=dim("feed_forward_length"),
        num_hidden_layers=dim("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=dim("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=positive_float(_required(fields, eps_key, source), eps_key, source),
        rope_theta=positive_float(fields.get(theta_key, 10000.0), theta_key, source),
        max_position_embeddings=dim("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=_rope_scaling(fields, p, source),
        bos_token_id=None if bos is None else token_id(bos, "tokenizer.ggml.bos_token_id", source),
        eos_token_ids=_eos_ids(fields, source),
        torch_dtype=None,  # quantized: no single checkpoint dtype
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=(None if window in (None, 0) else
                        dimension(window, f"{p}.attention.sliding_window", source)),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
    )
