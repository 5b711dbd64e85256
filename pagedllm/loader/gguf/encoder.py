"""A BERT encoder GGUF (llama.cpp's `bert` architecture, as convert_hf_to_gguf.py writes
all-MiniLM, bge and e5): its architecture, its tensors' HF names and how it pools.

llama.cpp keeps no activation name (its BERT graph runs GELU) and no sentence-transformers
files: the pooling is `bert.pooling_type` (llama.cpp's enum), and its embeddings server
L2-normalises every pooled vector.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import EncoderConfig, ModelArchConfig, PoolerConfig
from pagedllm.loader.arch_values import dimension, make_arch, positive_float
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.header import GGUFTensorInfo, gguf_header

_P = "bert"
# llama.cpp's LLAMA_POOLING_TYPE_* -> pooling_type (0 none: per-token vectors; 4 rank: a
# reranker's head; neither is an embedding of the sequence)
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
_NOT_EMBEDDINGS = {0: "none (one vector per token)", 4: "rank (a reranker's head)"}

_GLOBAL_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}


def bert_hf_name(gguf_name: str) -> Optional[str]:
    """HF BertModel parameter name of a bert GGUF tensor, or None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    module = _LAYER_NAMES.get(parts[2])
    if module is None or parts[3] not in ("weight", "bias"):
        return None
    return f"encoder.layer.{parts[1]}.{module}.{parts[3]}"


def _tensor(tensors: tuple[GGUFTensorInfo, ...], name: str, source: str | Path
            ) -> GGUFTensorInfo:
    """The tensor called name, or a ModelFileError naming it."""
    found = next((t for t in tensors if t.name == name), None)
    if found is None:
        raise ModelFileError(f"GGUF has no tensor {name!r} in {source}")
    return found


def bert_arch(fields: Mapping[str, Any], tensors: tuple[GGUFTensorInfo, ...],
              source: str | Path) -> ModelArchConfig:
    """ModelArchConfig of a `bert` GGUF; a classifier's head (llama.cpp's cls tensors, a
    reranker) is refused by name."""
    if any(t.name.startswith("cls") for t in tensors):
        raise ModelFileError(f"a bert GGUF with a classification head (tensors cls.*: a "
                             f"cross-encoder or classifier) is not supported, only embedding "
                             f"encoders; load its safetensors checkpoint instead ({source})")

    def dim(key: str) -> int:
        value = fields.get(f"{_P}.{key}")
        if value is None:
            raise ModelFileError(f"GGUF metadata has no {_P + '.' + key!r} in {source}")
        return dimension(value, f"{_P}.{key}", source)

    hidden, heads = dim("embedding_length"), dim("attention.head_count")
    embed, types = (_tensor(tensors, "token_embd.weight", source),
                    _tensor(tensors, "token_types.weight", source))
    eps_key = f"{_P}.attention.layer_norm_epsilon"
    if fields.get(eps_key) is None:
        raise ModelFileError(f"GGUF metadata has no {eps_key!r} in {source}")
    return make_arch(
        source, architecture="bert", vocab_size=embed.shape[0], hidden_size=hidden,
        intermediate_size=dim("feed_forward_length"), num_hidden_layers=dim("block_count"),
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, rope_theta=10000.0,  # unused by an encoder (HF's defaults)
        max_position_embeddings=dim("context_length"), tie_word_embeddings=False,
        attention_bias=True, rope_scaling=None, bos_token_id=None, eos_token_ids=(),
        torch_dtype=None, qk_norm=False, sliding_window=None,
        encoder=EncoderConfig(
            type_vocab_size=types.shape[0],  # the tensor's rows
            layer_norm_eps=positive_float(fields[eps_key], eps_key, source),
            hidden_act="gelu"))


def gguf_pooler_config(path: str | Path) -> PoolerConfig:
    """How a bert GGUF pools: `bert.pooling_type` (mean, CLS or last token), L2-normalised
    as llama.cpp's embeddings server does; ModelFileError for a pooling that is no sequence
    embedding, or a file that does not say."""
    fields, _ = gguf_header(path)
    key = f"{fields.get('general.architecture')}.pooling_type"
    value = fields.get(key)
    if value is None:
        raise ModelFileError(f"GGUF metadata has no {key!r} (how the encoder pools) in {path}")
    if value in _NOT_EMBEDDINGS:
        raise ModelFileError(f"{key}={value} ({_NOT_EMBEDDINGS[value]}) is not supported; "
                             f"supported: 1 mean, 2 cls, 3 last in {path}")
    if value not in _POOLING_TYPES:
        raise ModelFileError(f"{key}={value!r} is not a pooling type; supported: 1 mean, 2 cls, "
                             f"3 last in {path}")
    return PoolerConfig(_POOLING_TYPES[value], normalize=True)
