"""Mistral against transformers: a tiny random model with head_dim (32) apart from hidden/heads
(16), as Mistral-Nemo has, and no sliding window, through the HF directory and GGUFs (which
llama.cpp stores as the llama architecture: float32 and Q8_0), batched, with chunked prefill
and the prefix cache on; and one with a sliding window (12 tokens) far below its prompts, which
every layer attends over in prefill, in chunks over cached blocks, and in decode."""
from __future__ import annotations

import pytest
from transformers import MistralConfig, MistralForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, hf_reference, prompts, random_init, save_checkpoints)

POSITIONS, WINDOW = 256, 12


def _tiny_mistral(root, window, lengths):
    """A tiny Mistral with the given sliding window (None: none) as an HF directory and
    float32 / Q8_0 GGUFs, with prompts of the given lengths."""
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5,
                        sliding_window=window, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    model = MistralForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return save_checkpoints(model, root, "llama", lambda w: base_fields(w, cfg),
                            prompts(lengths, seed=1, shared=30), permute_heads=(4, 2))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """The tiny Mistral without a window."""
    return _tiny_mistral(tmp_path_factory.mktemp("mistral"), None, (12, 29, 51, 74))


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """The tiny Mistral with a 12-token window: the prompts share 30 tokens (two cached blocks
    with the prefix cache), and each is longer than the window by far."""
    return _tiny_mistral(tmp_path_factory.mktemp("mistral_window"), WINDOW, (41, 57, 74))


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


def test_the_window_is_attended_for_real(windowed):
    """transformers masks keys at or beyond the window (p - window < k <= p): the engine
    matches its logits and greedy tokens with max_model_len at all the positions (no cap)."""
    ref = hf_reference(windowed.model, windowed.prompts)
    llm = LLM(model=str(windowed.hf_dir), dtype="float32", **CHUNKED)
    config, runner = llm.llm_engine.config, model_runner(llm)
    assert config.arch.sliding_window == WINDOW
    assert config.scheduler.max_model_len == POSITIONS
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, WINDOW]
    assert runner.captured_decode is None
    check_float32(llm, ref)


def test_the_window_changes_what_the_model_computes(windowed):
    """Without its window the same weights give other logits: the test above could fail."""
    model = windowed.model
    ids = windowed.prompts[0]
    model.config.sliding_window = None
    try:
        full = hf_reference(model, [ids], num_tokens=1).logits[0]
    finally:
        model.config.sliding_window = WINDOW
    assert (full - hf_reference(model, [ids], num_tokens=1).logits[0]).abs().max() > 1e-2
