"""The model registry: known architectures map to classes; others fail with the supported list."""
import json

import pytest

from pagedllm import LLM
from pagedllm.models.llama import (LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                   Qwen3ForCausalLM)
from pagedllm.models.registry import model_class, supported_architectures


def test_known_architectures():
    assert model_class("llama") is LlamaForCausalLM
    assert model_class("qwen2") is Qwen2ForCausalLM
    assert model_class("qwen3") is Qwen3ForCausalLM
    assert model_class("phi3") is Phi3ForCausalLM
    assert supported_architectures() == ["llama", "phi3", "qwen2", "qwen3"]


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="'gpt2' is not supported.*llama, phi3, qwen2, qwen3"):
        model_class("gpt2")


def test_llm_on_an_unsupported_checkpoint_fails_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        LLM(model=str(tmp_path))
    assert "GPT2LMHeadModel" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) or "llama" in str(err.value)
