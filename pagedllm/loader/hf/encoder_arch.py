"""A BERT-family encoder's departures from the decoder (config.EncoderConfig), read from its
config.json, every value checked by its field name."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ENCODER_ACTIVATIONS, EncoderConfig
from pagedllm.loader.arch_values import dimension, positive_float
from pagedllm.loader.errors import ModelFileError

ENCODER_ARCHITECTURES = ("bert", "bert_classifier")


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
    return EncoderConfig(
        type_vocab_size=dimension(cfg.get("type_vocab_size", 2), "type_vocab_size", source),
        layer_norm_eps=positive_float(cfg.get("layer_norm_eps", 1e-12), "layer_norm_eps", source),
        hidden_act=act)
