"""Llama 3.x against transformers: a tiny random model with "llama3" RoPE scaling (high
frequencies kept, low ones divided by the factor, a blend between), through the HF directory and
GGUFs (float32 and Q8_0; the scaling as llama.cpp's rope_freqs tensor, Q/K rows in llama.cpp's
order), batched, with chunked prefill and the prefix cache on."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, hf_reference, prompts, random_init, save_checkpoints)

HEAD_DIM, THETA = 16, 10000.0
# with head_dim 16: wavelengths 6.3 (kept), 20 (blended), 63 and longer (divided by 8)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def rope_freqs(scaling: dict, dim: int, base: float) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for "llama3" scaling."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """The tiny Llama 3 as an HF directory and float32 / Q8_0 GGUFs."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_theta": THETA, **LLAMA3})
    model = LlamaForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp("llama3"), "llama",
                            lambda w: base_fields(w, cfg), prompts((9, 37, 58, 80), seed=1),
                            permute_heads=(4, 2),
                            extra={"rope_freqs.weight": rope_freqs(LLAMA3, HEAD_DIM, THETA)})


@pytest.fixture(scope="module")
def reference(llama3):
    return hf_reference(llama3.model, llama3.prompts)


def test_hf_directory_matches_transformers(llama3, reference):
    llm = LLM(model=str(llama3.hf_dir), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.arch.rope_scaling["rope_type"] == "llama3"
    check_float32(llm, reference)


def test_float32_gguf_reads_rope_freqs(llama3, reference):
    llm = LLM(model=str(llama3.f32_gguf), tokenizer=str(llama3.hf_dir), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.arch.rope_scaling["rope_type"] == "frequency_divisors"
    check_float32(llm, reference)


def test_q8_0_gguf_runs_its_blocks_through_the_captured_decode(llama3):
    llm = LLM(model=str(llama3.q8_0_gguf), tokenizer=str(llama3.hf_dir), **CHUNKED)
    assert model_runner(llm).decode_path.startswith("the C++ decode stack (llama layers")
    check_q8_0(llm, llama3)
    check_captured_equals_loop(llm, llama3.prompts)
