"""A BERT-family encoder's departures from the decoder (config.EncoderConfig), read from its
config.json, every value checked by its field name. XLM-RoBERTa (bge-m3, bge-reranker-v2-m3)
is the same encoder; it declares its positions' offset (padding_idx + 1) and no token types."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ENCODER_ACTIVATIONS, EncoderConfig
from pagedllm.loader.arch_values import dimension, positive_float, token_id
from pagedllm.loader.errors import ModelFileError

ENCODER_ARCHITECTURES = ("bert", "bert_classifier", "xlm_roberta", "xlm_roberta_classifier")
# RoBERTa's embeddings count positions from padding_idx + 1 (transformers'
# create_position_ids_from_input_ids over an unpadded sequence) and read no token types
_ROBERTA = ("xlm_roberta", "xlm_roberta_classifier")
_ROBERTA_PAD_ID = 1  # XLMRobertaConfig's pad_token_id


def encoder_from_hf(cfg: Mapping[str, Any], arch: str, source: str | Path
                    ) -> Optional[EncoderConfig]:
    """The encoder's config from config.json, or None for a decoder family; what the encoder
    does not run (relative positions, another activation) is refused by its key."""
    if arch not in ENCODER_ARCHITECTURES:
        return None
    positions = cfg.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise ModelFileError(f"position_embedding_type={positions!r} is not supported (only "
                             f"'absolute') in {source}")
    act = cfg.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise ModelFileError(f"hidden_act={act!r} is not supported; supported: "
                             f"{', '.join(ENCODER_ACTIVATIONS)} in {source}")
    roberta = arch in _ROBERTA
    pad = cfg.get("pad_token_id", _ROBERTA_PAD_ID) if roberta else None
    return EncoderConfig(
        type_vocab_size=dimension(cfg.get("type_vocab_size", 2), "type_vocab_size", source),
        layer_norm_eps=positive_float(cfg.get("layer_norm_eps", 1e-12), "layer_norm_eps", source),
        hidden_act=act,
        position_offset=0 if pad is None else token_id(pad, "pad_token_id", source) + 1,
        token_types=not roberta)
