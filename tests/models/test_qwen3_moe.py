"""Qwen3-MoE against transformers: a tiny random model with 8 experts, 2 chosen per token and
their probabilities renormalised (norm_topk_prob), per-head q/k norms, through the HF directory
and GGUFs (float32 and Q8_0 experts), batched, with chunked prefill and the prefix cache on;
and a config whose decoder_sparse_step leaves every other layer dense."""
from __future__ import annotations

import gguf
import pytest
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from pagedllm.layers.ggml_linear import GGMLMergedLinear
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.weights import arch_from_gguf
from tiny_models import (CHUNKED, F32, VOCAB, base_fields, check_captured_equals_loop_exactly,
                         check_float32, check_moe_op, check_q8_0,
                         gguf_tensors, hf_reference, prompts, random_init, save_checkpoints,
                         save_hf_dir, write_gguf)


def config(**overrides) -> Qwen3MoeConfig:
    """The tiny Qwen3-MoE's config."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen3MoeConfig(**{**values, **overrides})


def moe_fields(writer: gguf.GGUFWriter, cfg: Qwen3MoeConfig) -> None:
    """The keys llama.cpp's converter writes for qwen3moe."""
    base_fields(writer, cfg)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """The tiny Qwen3-MoE as an HF directory and float32 / Q8_0 GGUFs."""
    cfg = config()
    model = Qwen3MoeForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp("qwen3_moe"), "qwen3moe",
                            lambda w: moe_fields(w, cfg), prompts((5, 23, 40, 61), seed=1))


@pytest.fixture(scope="module")
def reference(qwen3_moe):
    return hf_reference(qwen3_moe.model, qwen3_moe.prompts)


def test_hf_directory_matches_transformers(qwen3_moe, reference):
    llm = LLM(model=str(qwen3_moe.hf_dir), dtype="float32", **CHUNKED)
    moe = llm.llm_engine.config.arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)
    assert moe.shared_expert_intermediate_size is None and moe.dense_layers == ()
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(qwen3_moe, reference):
    llm = LLM(model=str(qwen3_moe.f32_gguf), tokenizer=str(qwen3_moe.hf_dir), dtype="float32",
              **CHUNKED)
    # the GGUF's metadata and tensor table say what config.json says
    assert llm.llm_engine.config.arch.moe == resolve_checkpoint(qwen3_moe.hf_dir).arch.moe
    check_float32(llm, reference)


def test_q8_0_gguf_keeps_each_experts_blocks_and_runs_the_captured_decode(qwen3_moe):
    llm = LLM(model=str(qwen3_moe.q8_0_gguf), tokenizer=str(qwen3_moe.hf_dir), **CHUNKED)
    runner = model_runner(llm)
    assert llm.llm_engine.config.quantization == "gguf"
    assert runner.captured_decode is not None, runner.decode_path
    assert runner.decode_path == "the C++ decode stack (qwen3_moe layers, one call a step)"
    block = runner.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    assert all(isinstance(e.gate_up_proj, GGMLMergedLinear) and e.gate_up_proj.packed
               for e in block.experts)
    check_q8_0(llm, qwen3_moe)
    # the router, top k with renormalised weights, each chosen expert on its rows, in C++
    check_captured_equals_loop_exactly(llm, qwen3_moe.prompts)


@pytest.mark.parametrize("quantization", ["int8", "bf16"])
def test_x8_at_load_runs_dense_and_routed_layers_in_the_captured_decode(tmp_path, quantization):
    """decoder_sparse_step=2 regrouped at load (Q8_0 blocks, or bf16 matrices): a dense MLP
    layer then a routed one, both in the stack, equal to the layer loop."""
    cfg = config(decoder_sparse_step=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    random_init(model, seed=2, scale=0.2)
    save_hf_dir(model, tmp_path / "hf")
    llm = LLM(model=str(tmp_path / "hf"), quantization=quantization, **CHUNKED)
    assert model_runner(llm).model.model.layers[1].mlp.x8_args() is not None
    runner = model_runner(llm)
    assert runner.captured_decode is not None, runner.decode_path
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers] == [
        False, True]
    check_captured_equals_loop_exactly(llm, prompts((7, 30, 45), seed=3))


def test_int8_g128_experts_in_groups_run_in_the_captured_decode(tmp_path):
    """quantization="int8_g128" with rows of 128 values (hidden and expert widths 128): every
    expert's matrices in groups of 128 (one linear_x8 call for the chosen experts' gate/up), the
    routed block in the stack, equal to the layer loop."""
    from pagedllm.kernels.types import Q8_0G4

    cfg = config(hidden_size=128, moe_intermediate_size=128, intermediate_size=256,
                 decoder_sparse_step=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    random_init(model, seed=4, scale=0.2)
    save_hf_dir(model, tmp_path / "hf")
    llm = LLM(model=str(tmp_path / "hf"), quantization="int8_g128", **CHUNKED)
    runner = model_runner(llm)
    assert runner.captured_decode is not None, runner.decode_path
    block = runner.model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    assert all(set(e.gate_up_proj.qtypes) == {Q8_0G4} and e.down_proj.qtype == Q8_0G4
               for e in block.experts)
    check_captured_equals_loop_exactly(llm, prompts((7, 30, 45), seed=5))


def test_q8_0_gguf_dequantized_matches_transformers(qwen3_moe):
    """quantization='none': each expert's Q8_0 rows, split from the stacked tensor, decode to
    exactly the values transformers holds."""
    llm = LLM(model=str(qwen3_moe.q8_0_gguf), tokenizer=str(qwen3_moe.hf_dir), dtype="float32",
              quantization="none", **CHUNKED)
    check_float32(llm, hf_reference(qwen3_moe.q8_0_model, qwen3_moe.prompts))


def test_dense_layers_from_decoder_sparse_step(tmp_path):
    """decoder_sparse_step=2: layer 0 is a plain MLP, layer 1 routes to experts."""
    cfg = config(decoder_sparse_step=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    random_init(model, seed=2, scale=0.2)
    save_hf_dir(model, tmp_path / "hf")
    llm = LLM(model=str(tmp_path / "hf"), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.arch.moe.dense_layers == (0,)
    layers = model_runner(llm).model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True]
    check_float32(llm, hf_reference(model, prompts((7, 30, 45), seed=3)))


def test_a_gguf_with_sigmoid_routing_is_refused_by_its_key(qwen3_moe, tmp_path):
    cfg = qwen3_moe.model.config

    def fields(writer: gguf.GGUFWriter) -> None:
        moe_fields(writer, cfg)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    path = tmp_path / "sigmoid.gguf"
    write_gguf(path, "qwen3moe", fields, gguf_tensors(qwen3_moe.model, gguf.MODEL_ARCH.QWEN3MOE),
               F32)
    with pytest.raises(ModelFileError, match="qwen3moe.expert_gating_func=2 is not supported"):
        arch_from_gguf(path)


def test_the_x8_moe_op_equals_the_torch_block_and_is_the_same_row_alone_or_batched(qwen3_moe):
    llm = LLM(model=str(qwen3_moe.q8_0_gguf), tokenizer=str(qwen3_moe.hf_dir), **CHUNKED)
    check_moe_op(model_runner(llm).model.model.layers[0].mlp)
