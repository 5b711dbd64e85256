"""What a pooling checkpoint's config.json says about its output, whatever its body (a BERT
encoder or a decoder): a sequence-classification head (labels, the activations of a score and
of classify's probabilities, vLLM's classifier_from_token conversion of an LM head) and the
Matryoshka dimensions an embedding may be cut to. Every value is checked by its key."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.config import ClassifierConfig
from pagedllm.loader.arch_values import dimension
from pagedllm.loader.errors import ModelFileError

# sentence-transformers' cross-encoder activations, as config.json names them
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                   "torch.nn.modules.linear.Identity": "identity"}
# vLLM's ways of making a decoder's classifier from its LM head's rows of named tokens
# (config.json's "method"); Qwen3-Reranker's is_original_qwen3_reranker means the first
FROM_2_WAY_SOFTMAX = "from_2_way_softmax"


def matryoshka(cfg: Mapping[str, Any], source: str | Path
               ) -> tuple[Optional[tuple[int, ...]], bool]:
    """(matryoshka_dimensions, is_matryoshka) as vLLM reads them from config.json."""
    flag = cfg.get("is_matryoshka", False)
    if not isinstance(flag, bool):
        raise ModelFileError(f"is_matryoshka must be true or false, got {flag!r} in {source}")
    dims = cfg.get("matryoshka_dimensions")
    if dims is None:
        return None, flag
    if not isinstance(dims, list) or not dims:
        raise ModelFileError(f"matryoshka_dimensions must be a non-empty list of sizes, got "
                             f"{dims!r} in {source}")
    return tuple(dimension(d, "matryoshka_dimensions", source) for d in dims), flag


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


def _from_tokens(cfg: Mapping[str, Any], arch: str, source: str | Path) -> tuple[str, ...]:
    """The (false, true) tokens whose LM-head rows become a decoder's one-label classifier
    (vLLM's from_2_way_softmax: Qwen3-Reranker's is_original_qwen3_reranker, or method), or ()
    for a checkpoint with its own classifier weights."""
    original = cfg.get("is_original_qwen3_reranker", False)
    if not isinstance(original, bool):
        raise ModelFileError(f"is_original_qwen3_reranker must be true or false, got "
                             f"{original!r} in {source}")
    if original and arch != "qwen3":
        raise ModelFileError(f"is_original_qwen3_reranker is for Qwen3 checkpoints, this is "
                             f"{arch} in {source}")
    method = cfg.get("method", FROM_2_WAY_SOFTMAX if original else None)
    tokens = cfg.get("classifier_from_token")
    if method is None:
        if tokens is not None:
            raise ModelFileError(f"classifier_from_token needs method={FROM_2_WAY_SOFTMAX!r} "
                                 f"or is_original_qwen3_reranker=true in {source}")
        return ()
    if method != FROM_2_WAY_SOFTMAX:
        raise ModelFileError(f"method={method!r} is not supported; supported: "
                             f"{FROM_2_WAY_SOFTMAX} in {source}")
    if (not isinstance(tokens, list) or len(tokens) != 2
            or not all(isinstance(t, str) and t for t in tokens)):
        raise ModelFileError(f"classifier_from_token must name two tokens (false, true), e.g. "
                             f"[\"no\", \"yes\"], for {FROM_2_WAY_SOFTMAX}; got {tokens!r} in "
                             f"{source}")
    return tuple(tokens)


def classifier_from_hf(cfg: Mapping[str, Any], arch: str,
                       source: str | Path) -> ClassifierConfig:
    """The classification head of a *ForSequenceClassification config.json; made from the LM
    head's rows of two tokens, it has one label."""
    tokens = _from_tokens(cfg, arch, source)
    labels = ("LABEL_0",) if tokens else _labels(cfg, source)
    return ClassifierConfig(labels=labels,
                            score_activation=_score_activation(cfg, len(labels), source),
                            classify_activation=_classify_activation(cfg, len(labels), source),
                            from_tokens=tokens)
