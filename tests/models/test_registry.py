"""The model registry: known architectures map to classes; others fail with the supported list."""
import json

import pytest

from pagedllm.models.bert import BertModel
from pagedllm import LLM
from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.llama import (LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                   Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
                                   SmolLM3ForCausalLM)
from pagedllm.models.registry import model_class, supported_architectures


def test_known_architectures():
    assert model_class("llama") is LlamaForCausalLM
    assert model_class("qwen2") is Qwen2ForCausalLM
    assert model_class("qwen3") is Qwen3ForCausalLM
    assert model_class("phi3") is Phi3ForCausalLM
    assert model_class("qwen2_moe") is Qwen2MoeForCausalLM
    assert model_class("qwen3_moe") is Qwen3MoeForCausalLM
    assert model_class("gemma2") is Gemma2ForCausalLM
    assert model_class("gemma3") is Gemma3ForCausalLM
    assert model_class("smollm3") is SmolLM3ForCausalLM
    assert model_class("bert") is BertModel
    assert model_class("bert_classifier").__name__ == "BertForSequenceClassification"
    assert model_class("xlm_roberta") is BertModel  # its config declares the departures
    assert model_class("xlm_roberta_classifier").__name__ == "XLMRobertaForSequenceClassification"
    assert supported_architectures() == ["bert", "bert_classifier", "gemma2", "gemma3", "llama", "phi3", "qwen2",
                                         "qwen2_moe", "qwen3", "qwen3_moe", "smollm3", "xlm_roberta",
                                         "xlm_roberta_classifier"]


def test_a_decoder_with_a_classifier_gets_the_last_token_head_class():
    from pagedllm.config import ClassifierConfig
    from pagedllm.loader.hf.arch import arch_from_hf_config
    from pagedllm.models.registry import model_class_for
    cfg = dict(architectures=["Qwen3ForSequenceClassification"], vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, num_labels=1)
    arch = arch_from_hf_config(cfg)
    cls = model_class_for(arch)
    assert cls.__name__ == "Qwen3ForSequenceClassification" and issubclass(cls, Qwen3ForCausalLM)
    assert model_class_for(arch) is cls and arch.classifier == ClassifierConfig(
        ("LABEL_0",), classify_activation="sigmoid")


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="'gpt2' is not supported.*bert, bert_classifier, gemma2, gemma3, llama, phi3, qwen2, "
                                         "qwen2_moe, qwen3, qwen3_moe, smollm3, xlm_roberta"):
        model_class("gpt2")


def test_llm_on_an_unsupported_checkpoint_fails_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        LLM(model=str(tmp_path))
    assert "GPT2LMHeadModel" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) or "llama" in str(err.value)
