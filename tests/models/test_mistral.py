"""Mistral against transformers: a tiny random model with head_dim (32) apart from hidden/heads
(16), as Mistral-Nemo has, and no sliding window, through the HF directory and GGUFs (which
llama.cpp stores as the llama architecture: float32 and Q8_0), batched, with chunked prefill
and the prefix cache on. A window below the positions caps max_model_len (test_phi3.py)."""
from __future__ import annotations

import pytest
from transformers import MistralConfig, MistralForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, hf_reference, prompts, random_init, save_checkpoints)

POSITIONS = 256


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """The tiny Mistral as an HF directory and float32 / Q8_0 GGUFs."""
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5,
                        sliding_window=None, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    model = MistralForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp("mistral"), "llama",
                            lambda w: base_fields(w, cfg), prompts((12, 29, 51, 74), seed=1),
                            permute_heads=(4, 2))


@pytest.fixture(scope="module")
def reference(mistral):
    return hf_reference(mistral.model, mistral.prompts)


def test_hf_directory_matches_transformers(mistral, reference):
    llm = LLM(model=str(mistral.hf_dir), dtype="float32", **CHUNKED)
    config = llm.llm_engine.config
    assert (config.arch.architecture, config.arch.head_dim, config.arch.sliding_window) == (
        "llama", 32, None)
    assert config.scheduler.max_model_len == POSITIONS
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(mistral, reference):
    llm = LLM(model=str(mistral.f32_gguf), tokenizer=str(mistral.hf_dir), dtype="float32",
              **CHUNKED)
    check_float32(llm, reference)


def test_q8_0_gguf_runs_its_blocks_through_the_captured_decode(mistral):
    llm = LLM(model=str(mistral.q8_0_gguf), tokenizer=str(mistral.hf_dir), **CHUNKED)
    assert model_runner(llm).captured_decode is not None
    check_q8_0(llm, mistral)
    check_captured_equals_loop(llm, mistral.prompts)
