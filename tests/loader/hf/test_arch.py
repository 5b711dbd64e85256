"""config.json of each supported family -> ModelArchConfig; the rest refused by name."""
import pytest

from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.hf.arch import arch_from_hf_config

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


def test_partial_rotary_turns_part_of_each_head():
    phi4_mini = BASE | {"architectures": ["Phi3ForCausalLM"], "head_dim": 128, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
    arch = arch_from_hf_config(phi4_mini)
    assert (arch.rotary_dim, arch.rope_dim, arch.rope_scaling) == (96, 96, None)
    assert arch_from_hf_config(phi4_mini | {"partial_rotary_factor": 1.0}).rotary_dim is None
    with pytest.raises(ModelFileError, match=r"partial_rotary_factor must be a number in \(0, 1\]"):
        arch_from_hf_config(phi4_mini | {"partial_rotary_factor": 1.5})
    with pytest.raises(ModelFileError, match="rotary_dim must be even"):
        arch_from_hf_config(phi4_mini | {"head_dim": 16, "partial_rotary_factor": 0.2})  # 3 values



def test_sliding_window_is_read_where_it_applies():
    mistral = BASE | {"architectures": ["MistralForCausalLM"]}
    assert arch_from_hf_config(mistral | {"sliding_window": 2048}).sliding_window == 2048
    assert arch_from_hf_config(mistral | {"sliding_window": None}).sliding_window is None
    assert [arch_from_hf_config(mistral | {"sliding_window": 2048}).layer_window(i)
            for i in range(BASE["num_hidden_layers"])] == [2048] * BASE["num_hidden_layers"]
    # Qwen2/Qwen3 configs name a window that is off unless use_sliding_window
    qwen = BASE | {"architectures": ["Qwen3ForCausalLM"], "sliding_window": 1024}
    assert arch_from_hf_config(qwen).sliding_window is None
    on = arch_from_hf_config(qwen | {"use_sliding_window": True, "max_window_layers": 0})
    assert on.sliding_window == 1024 and on.full_attention_layers == ()
    with pytest.raises(ModelFileError, match="sliding_window must be >= 1"):
        arch_from_hf_config(mistral | {"sliding_window": -4})


@pytest.mark.parametrize("cls, fields", [
    ("Qwen2Config", {"max_window_layers": 2}),
    ("Qwen2Config", {"max_window_layers": 0}),
    ("Qwen3Config", {"max_window_layers": 3}),
    ("Qwen2MoeConfig", {"max_window_layers": 3}),
    ("Qwen3MoeConfig", {}),
    ("SmolLM3Config", {"no_rope_layer_interval": 2}),
    ("Qwen2Config", {"layer_types": ["sliding_attention", "full_attention"] * 2}),
])
def test_the_sliding_layers_are_those_transformers_fills_layer_types_with(cls, fields):
    """Each family's rule for which layers slide, read from the config transformers writes and
    from the same config without its layer_types (how older checkpoints come)."""
    import transformers
    cfg = getattr(transformers, cls)(vocab_size=32, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, use_sliding_window=True,
                                     sliding_window=16, **fields)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * 4  # Qwen3-MoE: all slide
    want = [16 if t == "sliding_attention" else None for t in types]
    written = cfg.to_dict()
    for config in (written, {k: v for k, v in written.items() if k != "layer_types"}):
        if "layer_types" in fields and config is not written:
            continue  # a config's own layer_types is not a family rule
        arch = arch_from_hf_config(config)
        assert [arch.layer_window(i) for i in range(4)] == want, config.get("layer_types")


def test_mistral_and_phi3_slide_on_every_layer_whatever_layer_types_say():
    types = ["full_attention", "sliding_attention"]
    for name in ("MistralForCausalLM", "Phi3ForCausalLM"):
        arch = arch_from_hf_config(BASE | {"architectures": [name], "num_hidden_layers": 2,
                                           "sliding_window": 8, "layer_types": types})
        assert [arch.layer_window(i) for i in range(2)] == [8, 8]
    with pytest.raises(ModelFileError, match="layer_types must list one of"):
        arch_from_hf_config(BASE | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8,
                                    "use_sliding_window": True, "layer_types": ["local"]})


def test_an_unsupported_family_is_refused_with_the_supported_list():
    with pytest.raises(ModelFileError) as err:
        arch_from_hf_config(BASE | {"architectures": ["FalconForCausalLM"]})
    assert "FalconForCausalLM" in str(err.value)
    assert "Qwen3ForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)


GEMMA2 = BASE | {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 3,
                 "sliding_window": 4096, "query_pre_attn_scalar": 144,
                 "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                 "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192}


def test_gemma2_reads_its_window_layers_scalar_and_caps():
    arch = arch_from_hf_config(GEMMA2)
    g = arch.gemma
    assert (g.sliding_layers, g.query_pre_attn_scalar) == ((0, 2), 144.0)
    assert (g.attn_logit_softcapping, g.final_logit_softcapping) == (50.0, 30.0)
    assert [arch.layer_window(i) for i in range(3)] == [4096, None, 4096]
    types = ["full_attention", "sliding_attention", "full_attention"]
    assert arch_from_hf_config(GEMMA2 | {"layer_types": types}).gemma.sliding_layers == (1,)


@pytest.mark.parametrize("change, field", [({"hidden_activation": "relu"}, "hidden_activation"),
                                           ({"layer_types": ["local"] * 3}, "layer_types"),
                                           ({"sliding_window": None}, "sliding_window"),
                                           ({"attn_logit_softcapping": -1}, "attn_logit")])
def test_gemma2_refuses_what_it_cannot_run_naming_the_field(change, field):
    with pytest.raises(ModelFileError, match=field):
        arch_from_hf_config(GEMMA2 | change)


MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_qwen3_moe_sparse_layers_from_decoder_sparse_step_and_mlp_only_layers():
    arch = arch_from_hf_config(BASE | MOE | {
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6, "norm_topk_prob": True,
        "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (arch.architecture, arch.qk_norm, arch.attention_bias) == ("qwen3_moe", True, False)
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob and moe.shared_expert_intermediate_size is None
    # transformers: sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    assert moe.dense_layers == (0, 2, 3, 4)
    assert [arch.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_qwen2_moe_has_a_shared_expert_and_qkv_biases_by_default():
    arch = arch_from_hf_config(BASE | MOE | {"model_type": "qwen2_moe",
                                             "shared_expert_intermediate_size": 96})
    assert (arch.architecture, arch.attention_bias, arch.qk_norm) == ("qwen2_moe", True, False)
    assert arch.moe.shared_expert_intermediate_size == 96 and not arch.moe.norm_topk_prob
    assert arch.moe.dense_layers == ()
    assert not arch_from_hf_config(BASE | MOE | {"model_type": "qwen2_moe", "qkv_bias": False,
                                                 "shared_expert_intermediate_size": 96}
                                   ).attention_bias


def test_moe_configs_that_cannot_route_are_refused_by_field():
    qwen3_moe = BASE | MOE | {"architectures": ["Qwen3MoeForCausalLM"]}
    with pytest.raises(ModelFileError, match="num_experts_per_tok \\(9\\) must be <= num_experts"):
        arch_from_hf_config(qwen3_moe | {"num_experts_per_tok": 9})
    with pytest.raises(ModelFileError, match="moe_intermediate_size"):
        arch_from_hf_config({k: v for k, v in qwen3_moe.items() if k != "moe_intermediate_size"})
    with pytest.raises(ModelFileError, match="shared_expert_intermediate_size"):
        arch_from_hf_config(BASE | MOE | {"architectures": ["Qwen2MoeForCausalLM"]})
