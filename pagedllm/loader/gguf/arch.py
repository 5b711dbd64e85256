"""A GGUF's metadata and tensor table -> ModelArchConfig, every number checked by key name."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ModelArchConfig, MoEConfig
from pagedllm.loader.arch_values import dimension, make_arch, positive_float, token_id
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gemma_arch import gemma_from_gguf, gemma_window
from pagedllm.loader.gguf.encoder import bert_arch
from pagedllm.loader.gguf.header import GGUFTensorInfo

# GGUF general.architecture -> registry key (llama.cpp stores Mistral as "llama").
GGUF_ARCHITECTURES: dict[str, str] = {"bert": "bert", "gemma2": "gemma2", "gemma3": "gemma3",
                                      "llama": "llama", "phi3": "phi3", "qwen2": "qwen2",
                                      "qwen2moe": "qwen2_moe", "qwen3": "qwen3",
                                      "qwen3moe": "qwen3_moe", "smollm3": "smollm3"}
# llama.cpp's SmolLM3 leaves every 4th layer without RoPE (n_no_rope_layer_step, fixed: the
# GGUF has no key for it)
_SMOLLM3_NOPE_STEP = 4
# llama.cpp's expert weights: Qwen3-MoE rescales the chosen experts' probabilities (norm_w),
# Qwen2-MoE does not, unless <arch>.expert_weights_norm says otherwise
_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}
_SOFTMAX_GATING = 1  # <arch>.expert_gating_func: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


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


def _moe(fields: Mapping[str, Any], tensors: tuple[GGUFTensorInfo, ...], p: str,
         num_layers: int, source: str | Path) -> Optional[MoEConfig]:
    """The routed experts of a qwen2moe / qwen3moe GGUF (None for a dense one): sparse layers
    are those with a router (blk.N.ffn_gate_inp), expert sizes from the metadata or, where an
    older converter left them out, the stacked tensors [experts, rows, cols] themselves."""
    if p not in _NORM_TOPK_PROB:
        return None
    by_name = {t.name: t for t in tensors}
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in by_name]
    if not sparse:
        raise ModelFileError(f"general.architecture={p!r} but no layer has an expert router "
                             f"(blk.N.ffn_gate_inp.weight) in {source}")
    stacked = by_name.get(f"blk.{sparse[0]}.ffn_gate_exps.weight")
    if stacked is None or len(stacked.shape) != 3:
        raise ModelFileError(f"GGUF tensor 'blk.{sparse[0]}.ffn_gate_exps.weight' must be "
                             f"[experts, rows, cols], got "
                             f"{None if stacked is None else stacked.shape} in {source}")
    shexp = by_name.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight")
    gating = fields.get(f"{p}.expert_gating_func")
    if gating not in (None, _SOFTMAX_GATING):
        raise ModelFileError(f"{p}.expert_gating_func={gating!r} is not supported (only softmax "
                             f"routing, {_SOFTMAX_GATING}) in {source}")

    def dim(key: str, default: Optional[int]) -> Optional[int]:
        value = fields.get(f"{p}.{key}", default)
        return None if value is None else dimension(value, f"{p}.{key}", source)

    try:
        return MoEConfig(
            num_experts=dim("expert_count", stacked.shape[0]),
            num_experts_per_tok=dimension(_required(fields, f"{p}.expert_used_count", source),
                                          f"{p}.expert_used_count", source),
            moe_intermediate_size=dim("expert_feed_forward_length", stacked.shape[1]),
            norm_topk_prob=bool(fields.get(f"{p}.expert_weights_norm", _NORM_TOPK_PROB[p])),
            shared_expert_intermediate_size=(None if shexp is None else dim(
                "expert_shared_feed_forward_length", shexp.shape[0])),
            dense_layers=tuple(i for i in range(num_layers) if i not in sparse))
    except ValueError as err:
        raise ModelFileError(f"{err} in {source}") from None


def arch_from_header(fields: Mapping[str, Any], tensors: tuple[GGUFTensorInfo, ...],
                     source: str | Path) -> ModelArchConfig:
    """ModelArchConfig from the `<arch>.*` keys and the tensor table of the GGUF at source."""
    p = _required(fields, "general.architecture", source)
    if p not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"general.architecture={p!r} is not supported; "
                             f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))} (in {source})")
    if p == "bert":
        return bert_arch(fields, tensors, source)

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
    moe = _moe(fields, tensors, p, dim("block_count"), source)
    gemma = gemma_from_gguf(fields, p, dim("block_count"), hidden, heads, head_dim, source)
    gemma_window(window, gemma, f"{p}.attention.sliding_window", source)
    return make_arch(
        source,
        architecture=GGUF_ARCHITECTURES[p],
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        # a MoE GGUF's feed_forward_length sizes its dense layers (if any)
        intermediate_size=dim("feed_forward_length",
                              moe.moe_intermediate_size if moe is not None else None),
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
        nope_layers=tuple(i for i in range(dim("block_count"))
                          if p == "smollm3" and (i + 1) % _SMOLLM3_NOPE_STEP == 0),
        moe=moe,
        gemma=gemma,
    )
