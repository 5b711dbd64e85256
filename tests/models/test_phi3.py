"""Phi-3 against transformers: a tiny random model with fused qkv_proj / gate_up_proj, LongRoPE
(distinct short and long factor sets, original context 64 of 256 positions, so an attention
factor of 1.15) and a sliding window (24) far below its prompts, through the HF directory and
GGUFs (float32 and Q8_0, the factors as llama.cpp's rope_factors_* tensors), batched, with
chunked prefill and the prefix cache on; and a tiny Phi-4-mini (the same class with RoPE over
3/4 of each head).

LongRoPE's factor set is chosen once, by max_model_len against the original context, so each
engine is compared on prompts that transformers runs with the same set: longer than the
original context for the long set, short enough to stay inside it for the short set."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from pagedllm.layers.linear import MergedLinear
from tiny_models import (CHUNKED, NUM_TOKENS, VOCAB, base_fields, check_captured_equals_loop,
                         check_float32, check_q8_0, hf_reference, prompts, random_init,
                         save_checkpoints)

POSITIONS, ORIGINAL, WINDOW, HEAD_DIM = 256, 64, 24, 16
LONG_PROMPTS = (70, 83, 97, 66)  # longer than ORIGINAL: the long factors
SHORT_PROMPTS = (5, 17, 30)  # with 32 new tokens, inside ORIGINAL: the short factors


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """The tiny Phi-3 as an HF directory and float32 / Q8_0 GGUFs, with its long prompts."""
    gen = torch.Generator().manual_seed(3)
    short = (1 + 0.5 * torch.rand(HEAD_DIM // 2, generator=gen)).tolist()
    long = (1 + 3 * torch.rand(HEAD_DIM // 2, generator=gen)).tolist()
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=POSITIONS, original_max_position_embeddings=ORIGINAL,
                     sliding_window=WINDOW, pad_token_id=None, bos_token_id=None,
                     eos_token_id=VOCAB - 1,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": short, "long_factor": long})
    model = Phi3ForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    attn_factor = math.sqrt(1 + math.log(POSITIONS / ORIGINAL) / math.log(ORIGINAL))

    def fields(writer):  # what llama.cpp's converter writes for Phi-3
        base_fields(writer, cfg)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_rope_scaling_attn_factors(attn_factor)
        writer.add_sliding_window(WINDOW)

    factors = {"rope_factors_long.weight": np.array(long, dtype=np.float32),
               "rope_factors_short.weight": np.array(short, dtype=np.float32)}
    return save_checkpoints(model, tmp_path_factory.mktemp("phi3"), "phi3", fields,
                            prompts(LONG_PROMPTS, seed=1, shared=40), extra=factors)


@pytest.fixture(scope="module")
def long_reference(phi3):
    return hf_reference(phi3.model, phi3.prompts)


def test_hf_directory_with_long_factors_and_the_window(phi3, long_reference, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(phi3.hf_dir), dtype="float32", **CHUNKED)
    assert llm.llm_engine.config.scheduler.max_model_len == POSITIONS  # the window caps nothing
    assert (f"LongRoPE long factors (max_model_len {POSITIONS} > original context {ORIGINAL})"
            in caplog.text)
    # the fused tensors were split into the shards of the merged layers
    attn = model_runner(llm).model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, MergedLinear) and attn.qkv_proj.output_sizes == (64, 32, 32)
    check_float32(llm, long_reference)


def test_hf_directory_with_short_factors(phi3):
    ref = hf_reference(phi3.model, prompts(SHORT_PROMPTS, seed=2))
    assert max(len(p) for p in ref.prompts) + NUM_TOKENS <= ORIGINAL
    llm = LLM(model=str(phi3.hf_dir), dtype="float32", max_model_len=ORIGINAL, **CHUNKED)
    check_float32(llm, ref)


def test_a_max_model_len_beyond_the_positions_is_refused(phi3):
    with pytest.raises(ValueError, match=f"max_model_len={POSITIONS + 1} is larger than the "
                       f"model supports \\({POSITIONS} positions\\)"):
        LLM(model=str(phi3.hf_dir), dtype="float32", max_model_len=POSITIONS + 1)


def test_float32_gguf_matches_transformers(phi3, long_reference):
    llm = LLM(model=str(phi3.f32_gguf), tokenizer=str(phi3.hf_dir), dtype="float32", **CHUNKED)
    arch = llm.llm_engine.config.arch
    assert (arch.architecture, arch.sliding_window) == ("phi3", WINDOW)
    assert arch.rope_scaling["rope_type"] == "longrope"
    check_float32(llm, long_reference)


def test_q8_0_gguf_decodes_its_window_through_the_captured_decode(phi3):
    llm = LLM(model=str(phi3.q8_0_gguf), tokenizer=str(phi3.hf_dir), **CHUNKED)
    runner = model_runner(llm)
    assert llm.llm_engine.config.quantization == "gguf"
    assert runner.captured_decode is not None, runner.decode_path
    check_q8_0(llm, phi3)
    check_captured_equals_loop(llm, phi3.prompts)  # the window and LongRoPE in C++ too


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    """A tiny Phi-4-mini: the Phi-3 decoder with RoPE over 3/4 of each head (24 of 32), LongRoPE
    factors for those 12 pairs, tied embeddings and no window."""
    gen = torch.Generator().manual_seed(4)
    short = (1 + 0.5 * torch.rand(12, generator=gen)).tolist()
    long = (1 + 3 * torch.rand(12, generator=gen)).tolist()
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=POSITIONS, original_max_position_embeddings=ORIGINAL,
                     tie_word_embeddings=True, pad_token_id=None, bos_token_id=None,
                     eos_token_id=VOCAB - 1,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.75,
                                      "short_factor": short, "long_factor": long})
    model = Phi3ForCausalLM(cfg).eval()
    random_init(model, seed=5, scale=0.2)

    def fields(writer):
        base_fields(writer, cfg)
        writer.add_rope_dimension_count(24)
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_sliding_window(0)  # how llama.cpp writes Phi-4's "no window"

    factors = {"rope_factors_long.weight": np.array(long, dtype=np.float32),
               "rope_factors_short.weight": np.array(short, dtype=np.float32)}
    return save_checkpoints(model, tmp_path_factory.mktemp("phi4_mini"), "phi3", fields,
                            prompts(LONG_PROMPTS, seed=6, shared=40), extra=factors)


def test_partial_rotary_phi4_mini_through_every_loader(phi4_mini):
    ref = hf_reference(phi4_mini.model, phi4_mini.prompts)
    tokenizer = {"tokenizer": str(phi4_mini.hf_dir)}
    for model, kwargs in ((phi4_mini.hf_dir, {}), (phi4_mini.f32_gguf, tokenizer)):
        llm = LLM(model=str(model), dtype="float32", **kwargs, **CHUNKED)
        assert llm.llm_engine.config.arch.rotary_dim == 24
        check_float32(llm, ref)
    llm = LLM(model=str(phi4_mini.q8_0_gguf), tokenizer=str(phi4_mini.hf_dir), **CHUNKED)
    assert model_runner(llm).captured_decode is not None
    check_q8_0(llm, phi4_mini)
    check_captured_equals_loop(llm, phi4_mini.prompts)
