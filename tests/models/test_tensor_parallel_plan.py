"""Tensor parallelism splits what the model's tp_plan declares and refuses the rest by name: a
module holding weights that no pattern covers, a module whose class does not fit its role, a
role that does not exist."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.config import ModelArchConfig
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.models.llama import Qwen2ForCausalLM
from pagedllm.models.tensor_parallel import planned_modules, shard_model

TP2 = TensorParallelRank(0, 2)


def _cfg() -> ModelArchConfig:
    return ModelArchConfig(architecture="qwen2", vocab_size=64, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                           rope_theta=10000.0, max_position_embeddings=64,
                           tie_word_embeddings=False, attention_bias=True)


def _model(cls: type = Qwen2ForCausalLM) -> nn.Module:
    with torch.device("meta"):
        return cls(_cfg(), 64)


def test_the_plan_names_every_module_that_holds_weights():
    roles = {path: role for path, role, _ in planned_modules(_model(), TP2)}
    assert roles == {
        "model.embed_tokens": "vocab", "lm_head": "vocab", "model.norm": "replicated",
        **{f"model.layers.{i}.{name}": role for i in range(2) for name, role in (
            ("input_layernorm", "replicated"), ("self_attn", "attention"),
            ("post_attention_layernorm", "replicated"), ("mlp", "feed_forward"))}}


def test_a_planned_model_splits_its_heads_and_rows():
    model = _model()
    shards = shard_model(model, TP2, None)
    assert model.model.layers[0].self_attn.num_heads == 2
    assert model.model.layers[1].mlp.down_proj.in_features == 32
    assert shards["model.layers.1.self_attn.q_proj.bias"].size == 16


def test_a_module_outside_the_plan_is_refused_by_name():
    model = _model()
    model.model.layers[1].adapter = nn.Linear(32, 32)  # a family's own module, undeclared
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: model\.layers\.1\.adapter "
                                         r"\(Linear\) holds weights and Qwen2ForCausalLM\.tp_plan "
                                         r"gives it no role"):
        shard_model(model, TP2, None)
    assert model.model.layers[0].self_attn.num_heads == 4  # checked before anything changed


def test_a_module_whose_class_does_not_fit_its_role_is_refused():
    model = _model()
    model.model.layers[0].self_attn = nn.Linear(32, 32)  # another attention class
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn is planned as attention "
                                         r"but is a Linear"):
        shard_model(model, TP2, None)


def test_an_unknown_role_is_refused():
    class Odd(Qwen2ForCausalLM):
        tp_plan = {**Qwen2ForCausalLM.tp_plan, "model.layers.*.mlp": "colwise"}

    with pytest.raises(ValueError, match=r"Odd\.tp_plan gives 'model\.layers\.\*\.mlp' the role "
                                         r"'colwise'; the roles are vocab, attention"):
        shard_model(_model(Odd), TP2, None)


def test_an_o_proj_in_groups_of_128_that_a_rank_would_cut_names_int8():
    """int8_g128's o_proj (the default model's 896 values a row: 448 a rank of 2) cannot keep
    whole 128-value groups per rank: refused naming the matrix and quantization='int8'."""
    from pagedllm.kernels.types import Q8_0G4
    from pagedllm.models.tensor_parallel import _check_blocks

    path = "model.layers.0.self_attn.o_proj"
    _check_blocks(path, range(512, 1024), {path: Q8_0G4}, TP2)  # 512 a rank: whole groups
    with pytest.raises(ValueError, match=r"o_proj\.weight is kept in Q8_0G4 blocks of 128 values.*"
                                         r"quantization='int8'"):
        _check_blocks(path, range(448, 896), {path: Q8_0G4}, TP2)
