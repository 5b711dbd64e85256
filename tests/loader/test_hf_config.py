"""config.json of each supported family -> ModelArchConfig; the rest refused by name."""
import pytest

from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.hf_config import arch_from_hf_config

BASE = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


def test_qwen3_has_q_k_norms_its_own_head_dim_and_no_biases():
    arch = arch_from_hf_config(BASE | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert (arch.architecture, arch.qk_norm, arch.attention_bias, arch.head_dim) == (
        "qwen3", True, False, 32)
    assert arch_from_hf_config(BASE | {"model_type": "qwen3"}).architecture == "qwen3"


def test_phi3_longrope_in_its_legacy_and_current_spellings():
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    legacy = arch_from_hf_config(BASE | {
        "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 1024,
        "sliding_window": 2047, "rope_scaling": {"type": "su", **factors}})
    assert legacy.architecture == "phi3" and legacy.sliding_window == 2047
    assert legacy.rope_scaling["rope_type"] == "longrope"
    assert legacy.rope_scaling["original_max_position_embeddings"] == 1024
    current = arch_from_hf_config(BASE | {"model_type": "phi3", "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "original_max_position_embeddings": 1024, **factors}})
    assert current.rope_scaling == {"rope_type": "longrope",
                                    "original_max_position_embeddings": 1024, **factors}
    plain = arch_from_hf_config(BASE | {"model_type": "phi3", "rope_scaling": None})
    assert plain.rope_scaling is None


def test_partial_rotary_is_refused_by_name():
    with pytest.raises(ModelFileError, match="partial_rotary_factor=0.75 is not supported"):
        arch_from_hf_config(BASE | {"architectures": ["Phi3ForCausalLM"], "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}})


def test_sliding_window_is_read_where_it_applies():
    mistral = BASE | {"architectures": ["MistralForCausalLM"]}
    assert arch_from_hf_config(mistral | {"sliding_window": 2048}).sliding_window == 2048
    assert arch_from_hf_config(mistral | {"sliding_window": None}).sliding_window is None
    wide = arch_from_hf_config(mistral | {"sliding_window": 8192})  # beyond the 4096 positions
    assert wide.max_model_len_supported == 4096
    # Qwen2/Qwen3 configs name a window that is off unless use_sliding_window
    qwen = BASE | {"architectures": ["Qwen3ForCausalLM"], "sliding_window": 1024}
    assert arch_from_hf_config(qwen).sliding_window is None
    on = arch_from_hf_config(qwen | {"use_sliding_window": True})
    assert (on.sliding_window, on.max_model_len_supported) == (1024, 1024)
    with pytest.raises(ModelFileError, match="sliding_window must be >= 1"):
        arch_from_hf_config(mistral | {"sliding_window": -4})


def test_an_unsupported_family_is_refused_with_the_supported_list():
    with pytest.raises(ModelFileError) as err:
        arch_from_hf_config(BASE | {"architectures": ["Gemma2ForCausalLM"]})
    assert "Gemma2ForCausalLM" in str(err.value)
    assert "Qwen3ForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)
