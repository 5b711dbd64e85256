"""A BERT-family encoder's departures from the decoder (config.EncoderConfig), read from its
config.json, every value checked by its field name."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ENCODER_ACTIVATIONS, EncoderConfig
from pagedllm.loader.arch_values import dimension, positive_float
from pagedllm.loader.errors import ModelFileError

ENCODER_ARCHITECTURES = ("bert", "bert_classifier")
# sentence-transformers' cross-encoder activations, as config.json names them
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                   "torch.nn.modules.linear.Identity": "identity"}


def _matryoshka(cfg: Mapping[str, Any], source: str | Path) -> Optional[tuple[int, ...]]:
    """matryoshka_dimensions as vLLM reads it from config.json, or None."""
    dims = cfg.get("matryoshka_dimensions")
    if dims is None:
        return None
    if not isinstance(dims, list) or not dims:
        raise ModelFileError(f"matryoshka_dimensions must be a non-empty list of sizes, got "
                             f"{dims!r} in {source}")
    return tuple(dimension(d, "matryoshka_dimensions", source) for d in dims)


def _labels(cfg: Mapping[str, Any], source: str | Path) -> tuple[str, ...]:
    """A classification head's labels in id order: id2label, else num_labels' LABEL_i (as
    transformers names them), else transformers' default of two."""
    id2label = cfg.get("id2label")
    if id2label is not None:
        if not isinstance(id2label, Mapping) or not id2label:
            raise ModelFileError(f"id2label must be a non-empty object, got {id2label!r} in "
                                 f"{source}")
        try:
            ids = sorted(int(k) for k in id2label)
        except (TypeError, ValueError):
            raise ModelFileError(f"id2label's keys must be label ids, got {list(id2label)!r} "
                                 f"in {source}") from None
        if ids != list(range(len(ids))):
            raise ModelFileError(f"id2label's keys must be 0..{len(ids) - 1}, got {ids} in "
                                 f"{source}")
        by_id = {int(k): v for k, v in id2label.items()}
        return tuple(str(by_id[i]) for i in ids)
    n = dimension(cfg.get("num_labels", 2), "num_labels", source)
    return tuple(f"LABEL_{i}" for i in range(n))


def _score_activation(cfg: Mapping[str, Any], num_labels: int, source: str | Path) -> str:
    """What a cross-encoder's logit goes through for a score, as sentence-transformers and
    vLLM decide: config.json's sentence_transformers.activation_fn or
    sbert_ce_default_activation_function, else a sigmoid for one label (softmax for more)."""
    named = (cfg.get("sentence_transformers") or {}).get("activation_fn") \
        if isinstance(cfg.get("sentence_transformers"), Mapping) else None
    named = named or cfg.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid" if num_labels < 2 else "softmax"
    if named not in _ST_ACTIVATIONS:
        raise ModelFileError(f"the cross-encoder's activation_fn {named!r} is not supported; "
                             f"supported: {', '.join(_ST_ACTIVATIONS)} in {source}")
    return _ST_ACTIVATIONS[named]


def _classify_activation(cfg: Mapping[str, Any], num_labels: int, source: str | Path) -> str:
    """What classify's probabilities are, by config.json's problem_type as transformers trains
    it (and vLLM reads it): regression none, multi-label a sigmoid each, else a softmax (a
    sigmoid for one label)."""
    kind = cfg.get("problem_type")
    if kind == "regression":
        return "identity"
    if kind == "multi_label_classification":
        return "sigmoid"
    if kind not in (None, "single_label_classification"):
        raise ModelFileError(f"problem_type={kind!r} is not supported; supported: regression, "
                             f"single_label_classification, multi_label_classification in "
                             f"{source}")
    return "sigmoid" if num_labels < 2 else "softmax"


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
    matryoshka = cfg.get("is_matryoshka", False)
    if not isinstance(matryoshka, bool):
        raise ModelFileError(f"is_matryoshka must be true or false, got {matryoshka!r} in {source}")
    labels = _labels(cfg, source) if arch == "bert_classifier" else ()
    return EncoderConfig(
        labels=labels,
        score_activation=_score_activation(cfg, len(labels), source),
        classify_activation=_classify_activation(cfg, len(labels), source),
        type_vocab_size=dimension(cfg.get("type_vocab_size", 2), "type_vocab_size", source),
        layer_norm_eps=positive_float(cfg.get("layer_norm_eps", 1e-12), "layer_norm_eps", source),
        hidden_act=act,
        matryoshka_dimensions=_matryoshka(cfg, source),
        is_matryoshka=matryoshka)
