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


def _grouped_plan(heads: int) -> tuple[dict, dict]:
    """int8_g128's plan of a meta Qwen2 with 384-value rows and `heads` heads of 64 values,
    before and after rank 0 of 2 takes its share."""
    from pagedllm.layers.quantization import float_quant_plan

    cfg = ModelArchConfig(architecture="qwen2", vocab_size=64, hidden_size=384,
                          intermediate_size=512, num_hidden_layers=2, num_attention_heads=heads,
                          num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                          rope_theta=10000.0, max_position_embeddings=64,
                          tie_word_embeddings=False, attention_bias=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg, 64)
    plan = float_quant_plan(model, "int8_g128")
    before = dict(plan)
    shard_model(model, TP2, plan)
    return before, plan


def test_an_o_proj_in_groups_of_128_that_a_rank_would_cut_keeps_q8_0():
    """int8_g128 (a scale per 128 values): an o_proj whose rank part cuts a group (6 heads of 64,
    192 values a rank, as the default model's 448) keeps Q8_0 (a scale per 32 values) on every
    rank; every other matrix keeps its groups, and an o_proj split at whole groups (4 heads: 128
    a rank) keeps them too."""
    from pagedllm.kernels.types import Q8_0G4
    from pagedllm.layers.quantization import Q8_0

    before, after = _grouped_plan(6)
    assert set(before.values()) == {Q8_0G4}
    assert {p: q for p, q in after.items() if q != Q8_0G4} == {
        f"model.layers.{i}.self_attn.o_proj": Q8_0 for i in range(2)}
    before, after = _grouped_plan(4)
    assert after == before


def test_a_block_cut_by_a_rank_is_refused_naming_the_matrix():
    """A kept block format whose blocks a rank's o_proj part would cut is refused by name."""
    from pagedllm.layers.quantization import Q8_0
    from pagedllm.models.tensor_parallel import _check_blocks

    path = "model.layers.0.self_attn.o_proj"
    _check_blocks(path, range(448, 896), {path: Q8_0}, TP2)  # 448 a rank: whole Q8_0 blocks
    with pytest.raises(ValueError, match=r"o_proj\.weight is kept in Q8_0 blocks of 32 values, "
                                         r"and its rows of 48 values split into 24 per rank"):
        _check_blocks(path, range(24, 48), {path: Q8_0}, TP2)
