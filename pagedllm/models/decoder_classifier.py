"""A decoder with a sequence-classification head over its last token (HF's
Qwen3ForSequenceClassification; vLLM's as_seq_cls_model): Qwen3-Reranker and its kin.

The head is the checkpoint's `score` matrix, or, for a causal LM read as a classifier through
vLLM's classifier_from_token (from_2_way_softmax), two rows of its LM head: the logit of the
true token less that of the false one is one logit, and its sigmoid is
softmax([no, yes])[yes], the reranker's relevance.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.config import ModelArchConfig


class _LastTokenClassifier:
    """Mixed in before a causal LM class: its hidden states come out of forward unchanged;
    `classify` turns each sequence's last row into the head's logits."""

    config: ModelArchConfig
    lm_head: nn.Linear

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)  # type: ignore[call-arg]
        head = cfg.classifier
        if head is None:
            raise ValueError(f"architecture {cfg.architecture!r} has no classification head")
        if head.from_tokens and not head.token_ids:
            raise ValueError(f"classifier_from_token {list(head.from_tokens)} has no token ids "
                             "(the engine reads them from the tokenizer before loading)")
        if not head.from_tokens:  # HF's *ForSequenceClassification: score instead of lm_head
            del self.lm_head
            self.score = nn.Linear(cfg.hidden_size, head.num_labels, bias=False)

    def classify(self, last_rows: torch.Tensor) -> torch.Tensor:
        """[N, H] hidden states of each sequence's last token -> [N, labels] logits."""
        head = self.config.classifier
        assert head is not None
        if not head.from_tokens:
            return self.score(last_rows)
        false_id, true_id = head.token_ids
        w = self.lm_head.weight  # [V, H]; two rows a call, in float32 as vLLM converts them
        weight = w[true_id:true_id + 1].float() - w[false_id:false_id + 1].float()  # [1, H]
        return F.linear(last_rows.float(), weight)

    def tie_weights(self) -> None:
        """The LM head (only kept to read two rows from) shares the embedding when tied."""
        head = self.config.classifier
        if head is not None and head.from_tokens:
            super().tie_weights()  # type: ignore[misc]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a classifier pools and does not generate")


@functools.cache
def with_classifier(causal_lm: type[nn.Module]) -> type[nn.Module]:
    """The *ForSequenceClassification class of a causal LM class (one per class)."""
    name = causal_lm.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return type(name, (_LastTokenClassifier, causal_lm),
                {"__doc__": f"{causal_lm.__name__} with a last-token classification head."})
