"""hf_overrides merged over config.json (vLLM's): a key replaces the checkpoint's value, a key
nothing reads for the model is refused by name; and the pooling keys it is used for
(Matryoshka, a decoder's classifier) and XLM-RoBERTa's departures, read from config.json."""
from __future__ import annotations

import re

import pytest

from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.hf.arch import arch_from_hf_config
from pagedllm.loader.hf.hf_overrides import arch_with_overrides

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def test_an_override_replaces_the_value_read():
    arch = arch_with_overrides(QWEN3, {"max_position_embeddings": 64,
                                       "matryoshka_dimensions": [8, 16]}, "c.json")
    assert arch.max_position_embeddings == 64 and arch.matryoshka_dimensions == (8, 16)
    assert arch.classifier is None and arch_from_hf_config(QWEN3).max_position_embeddings == 256


@pytest.mark.parametrize("overrides,unread", [
    ({"max_postion_embeddings": 64}, "['max_postion_embeddings']"),  # a typo
    ({"is_original_qwen3_reranker": True, "use_pad_token": False},
     "['is_original_qwen3_reranker', 'use_pad_token']"),
])
def test_keys_nothing_reads_are_refused(overrides, unread):
    with pytest.raises(ValueError, match=rf"hf_overrides {re.escape(unread)}: "
                                         "pagedllm does not read"):
        arch_with_overrides(QWEN3, overrides, "c.json")


def test_a_gemma3_override_of_its_rope_is_read():
    gemma = dict(QWEN3, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                 query_pre_attn_scalar=8, sliding_window=16)
    arch = arch_with_overrides(gemma, {"rope_theta": 5000.0}, "c.json")
    assert arch.rope_theta == 5000.0


def test_the_reranker_overrides_make_a_one_label_classifier():
    arch = arch_with_overrides(QWEN3, {"architectures": ["Qwen3ForSequenceClassification"],
                                       "classifier_from_token": ["no", "yes"],
                                       "is_original_qwen3_reranker": True}, "c.json")
    head = arch.classifier
    assert arch.architecture == "qwen3" and not arch.is_encoder and not arch.uses_token_types
    assert (head.labels, head.from_tokens, head.score_activation) == (("LABEL_0",),
                                                                     ("no", "yes"), "sigmoid")
    with pytest.raises(ModelFileError, match="is_original_qwen3_reranker is for Qwen3"):
        arch_from_hf_config(dict(QWEN3, architectures=["Qwen2ForSequenceClassification"],
                                 classifier_from_token=["no", "yes"],
                                 is_original_qwen3_reranker=True))


def test_xlm_roberta_declares_its_positions_and_no_token_types():
    cfg = dict(architectures=["XLMRobertaForSequenceClassification"], vocab_size=100,
               hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, num_labels=1)
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "xlm_roberta_classifier" and arch.num_labels == 1
    assert (arch.encoder.position_offset, arch.max_positions) == (2, 512)
    assert arch.is_encoder and not arch.uses_token_types
    with pytest.raises(ModelFileError, match="pad_token_id must be >= 0"):
        arch_from_hf_config(dict(cfg, pad_token_id=-1))
