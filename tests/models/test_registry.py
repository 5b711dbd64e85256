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
    assert supported_architectures() == ["bert", "bert_classifier", "gemma2", "gemma3", "llama", "phi3", "qwen2",
                                         "qwen2_moe", "qwen3", "qwen3_moe", "smollm3"]


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="'gpt2' is not supported.*bert, bert_classifier, gemma2, gemma3, llama, phi3, qwen2, "
                                         "qwen2_moe, qwen3, qwen3_moe, smollm3"):
        model_class("gpt2")


def test_llm_on_an_unsupported_checkpoint_fails_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        LLM(model=str(tmp_path))
    assert "GPT2LMHeadModel" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) or "llama" in str(err.value)
