"""Qwen2 with use_sliding_window against transformers: a tiny random model whose layers from
max_window_layers (1) on attend over the last 10 tokens and whose first layer over all of
them, prompts far longer than the window, batched, with chunked prefill and the prefix cache
on. (llama.cpp runs Qwen2 GGUFs without a window, so only the HF directory carries one.)"""
from __future__ import annotations

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from tiny_models import (CHUNKED, VOCAB, check_float32, hf_reference, prompts, random_init,
                         save_hf_dir)

POSITIONS, WINDOW = 256, 10


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """The tiny windowed Qwen2 and its HF directory."""
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=POSITIONS, rms_norm_eps=1e-6,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    model = Qwen2ForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return model, save_hf_dir(model, tmp_path_factory.mktemp("qwen2_window") / "hf")


def test_the_sliding_layers_match_transformers(qwen2):
    model, hf_dir = qwen2
    ref = hf_reference(model, prompts((44, 63, 70), seed=1, shared=36))
    llm = LLM(model=str(hf_dir), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.scheduler.max_model_len == POSITIONS
    runner = model_runner(llm)
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, WINDOW, WINDOW]
    assert runner.captured_decode is None
    check_float32(llm, ref)
