"""Qwen2-MoE against transformers: a tiny random model with q/k/v biases, 8 experts of which 2
are chosen per token (probabilities not renormalised) and a shared expert scaled by its sigmoid
gate, through the HF directory and GGUFs (float32 and Q8_0 experts), batched, with chunked
prefill and the prefix cache on."""
from __future__ import annotations

import gguf
import pytest
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.memory.weight_layout import gguf_weight_bytes
from tiny_models import (CHUNKED, F32, VOCAB, base_fields, check_captured_equals_loop_exactly,
                         check_float32, check_moe_op, check_q8_0,
                         gguf_tensors, hf_reference, max_logit_error, prompts, random_init,
                         save_checkpoints, write_gguf)


def moe_fields(writer: gguf.GGUFWriter, cfg: Qwen2MoeConfig) -> None:
    """The keys llama.cpp's converter writes for qwen2moe."""
    base_fields(writer, cfg)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def tiny_qwen2_moe(tmp_path_factory, name: str, moe_intermediate_size: int,
                   prompt_lens: tuple[int, ...]):
    """A tiny random Qwen2-MoE (2 layers, hidden 64, 8 experts of moe_intermediate_size rows,
    2 chosen per token, a shared expert of 96) saved as an HF directory and float32 / Q8_0
    GGUFs, with prompts of prompt_lens tokens."""
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=moe_intermediate_size,
                         shared_expert_intermediate_size=96,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen2MoeForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp(name), "qwen2moe",
                            lambda w: moe_fields(w, cfg), prompts(prompt_lens, seed=1))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """The tiny Qwen2-MoE as an HF directory and float32 / Q8_0 GGUFs."""
    return tiny_qwen2_moe(tmp_path_factory, "qwen2_moe", 32, (5, 23, 40, 61))


@pytest.fixture(scope="module")
def reference(qwen2_moe):
    return hf_reference(qwen2_moe.model, qwen2_moe.prompts)


def test_hf_directory_matches_transformers(qwen2_moe, reference):
    llm = LLM(model=str(qwen2_moe.hf_dir), dtype="float32", **CHUNKED)
    arch = llm.llm_engine.config.arch
    assert arch.attention_bias and not arch.moe.norm_topk_prob
    assert arch.moe.shared_expert_intermediate_size == 96
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(qwen2_moe, reference):
    llm = LLM(model=str(qwen2_moe.f32_gguf), tokenizer=str(qwen2_moe.hf_dir), dtype="float32",
              **CHUNKED)
    assert llm.llm_engine.config.arch.moe == resolve_checkpoint(qwen2_moe.hf_dir).arch.moe
    check_float32(llm, reference)


def test_q8_0_gguf_keeps_its_blocks_and_runs_the_captured_decode(qwen2_moe):
    llm = LLM(model=str(qwen2_moe.q8_0_gguf), tokenizer=str(qwen2_moe.hf_dir), **CHUNKED)
    runner = model_runner(llm)
    assert llm.llm_engine.config.quantization == "gguf"
    assert runner.decode_path == "the C++ decode stack (qwen2_moe layers, one call a step)"
    shared = runner.model.model.layers[1].mlp.shared_expert
    assert shared.gate_up_proj.packed and shared.down_proj.packed
    check_q8_0(llm, qwen2_moe)
    # routed experts without renormalising, and the sigmoid-gated shared expert, in C++
    check_captured_equals_loop_exactly(llm, qwen2_moe.prompts)


def test_the_planner_counts_each_experts_kept_blocks(qwen2_moe):
    """The weight bytes planned from the Q8_0 GGUF's tensor table (stacked experts kept in
    blocks, routers and norms in float32) are what the loaded model holds."""
    llm = LLM(model=str(qwen2_moe.q8_0_gguf), tokenizer=str(qwen2_moe.hf_dir), **CHUNKED)
    ckpt = resolve_checkpoint(qwen2_moe.q8_0_gguf)
    planned = gguf_weight_bytes(ckpt, llm.llm_engine.config.platform.block_types(), 4)
    held = sum(p.numel() * p.element_size() for p in model_runner(llm).model.parameters())
    assert planned == held
    assert planned < gguf_weight_bytes(ckpt, frozenset(), 4) / 3  # not counted as float32


def test_a_one_dimensional_shared_expert_gate_loads_too(qwen2_moe, reference, tmp_path):
    """llama.cpp reads ffn_gate_inp_shexp as [hidden]; a file that stores it so loads into the
    same one-row gate."""
    tensors = gguf_tensors(qwen2_moe.model, gguf.MODEL_ARCH.QWEN2MOE)
    for name in [n for n in tensors if n.endswith("ffn_gate_inp_shexp.weight")]:
        tensors[name] = tensors[name].reshape(-1)  # [1, H] -> [H]
    path = tmp_path / "flat_gate.gguf"
    write_gguf(path, "qwen2moe", lambda w: moe_fields(w, qwen2_moe.model.config), tensors, F32)
    llm = LLM(model=str(path), tokenizer=str(qwen2_moe.hf_dir), dtype="float32", **CHUNKED)
    assert max_logit_error(llm, reference) <= 1e-4



def test_the_x8_moe_op_equals_the_torch_block_and_is_the_same_row_alone_or_batched(qwen2_moe):
    llm = LLM(model=str(qwen2_moe.q8_0_gguf), tokenizer=str(qwen2_moe.hf_dir), **CHUNKED)
    check_moe_op(model_runner(llm).model.model.layers[1].mlp)  # with the shared expert
