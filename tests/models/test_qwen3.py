"""Qwen3 (dense) against transformers: a tiny random model whose head_dim (32) differs from
hidden/heads (16), with its per-head q/k norms, through the HF directory and GGUFs (float32 and
Q8_0), batched, with chunked prefill and the prefix cache on."""
from __future__ import annotations

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, hf_reference, prompts, random_init, save_checkpoints)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 as an HF directory and float32 / Q8_0 GGUFs."""
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3ForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp("qwen3"), "qwen3",
                            lambda w: base_fields(w, cfg), prompts((5, 23, 40, 61), seed=1))


@pytest.fixture(scope="module")
def reference(qwen3):
    return hf_reference(qwen3.model, qwen3.prompts)


def test_hf_directory_matches_transformers(qwen3, reference):
    llm = LLM(model=str(qwen3.hf_dir), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.arch.qk_norm
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(qwen3, reference):
    llm = LLM(model=str(qwen3.f32_gguf), tokenizer=str(qwen3.hf_dir), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.arch.head_dim == 32
    check_float32(llm, reference)


def test_q8_0_gguf_runs_its_blocks_through_the_captured_decode(qwen3):
    llm = LLM(model=str(qwen3.q8_0_gguf), tokenizer=str(qwen3.hf_dir), **CHUNKED)
    runner = model_runner(llm)
    assert llm.llm_engine.config.quantization == "gguf"
    assert runner.captured_decode is not None, runner.decode_path
    assert runner.decode_path.startswith("the C++ decode stack (qwen3 layers")
    check_q8_0(llm, qwen3)
    check_captured_equals_loop(llm, qwen3.prompts)  # q/k norms in C++ too
