"""Gemma 2 against transformers (eager attention, which applies the window and the soft-cap): a
tiny random model of three layers, local / global / local, whose sliding window (8) is shorter
than every prompt but the first, so the window binds in prefill, in chunked prefill reading the
paged cache, and in decode; attention and final logits soft-capped at values that bind;
through the HF directory and float32 / Q8_0 GGUFs, batched, with chunked prefill and the prefix
cache on."""
from __future__ import annotations

import gguf
import pytest
from transformers import Gemma2Config, Gemma2ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, gguf_tensors, gemma_init, hf_reference, prompts,
                         save_checkpoints)

WINDOW = 8
ATTN_CAP, FINAL_CAP = 2.0, 1.0


def gemma2_fields(writer, cfg) -> None:
    """The gemma2 GGUF keys llama.cpp's converter writes."""
    base_fields(writer, cfg)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """The tiny Gemma 2 as an HF directory and float32 / Q8_0 GGUFs (norms stored as 1 + w,
    as llama.cpp's converter writes them)."""
    model = tiny_gemma2()
    cfg = model.config
    norms = {name: arr + 1 for name, arr in gguf_tensors(model, gguf.MODEL_ARCH.GEMMA2).items()
             if name.endswith("norm.weight")}
    return save_checkpoints(model, tmp_path_factory.mktemp("gemma2"), "gemma2",
                            lambda w: gemma2_fields(w, cfg), prompts((5, 23, 40, 61), seed=1),
                            extra=norms)


def tiny_gemma2(**changes) -> Gemma2ForCausalLM:
    """The tiny random Gemma 2, its config changed by `changes`. Norm weights near 0 (Gemma
    scales by 1 + w), embeddings small: the tied head reads the embedding, scaled by
    sqrt(hidden), back out of the residual, and larger ones make it repeat its input token."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, sliding_window=WINDOW, tie_word_embeddings=True,
                  attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  attn_implementation="eager")
    model = Gemma2ForCausalLM(Gemma2Config(**{**fields, **changes})).eval()
    gemma_init(model)
    return model


@pytest.fixture(scope="module")
def reference(gemma2):
    assert gemma2.model.config._attn_implementation == "eager"
    return hf_reference(gemma2.model, gemma2.prompts)


def test_hf_directory_matches_transformers(gemma2, reference):
    llm = LLM(model=str(gemma2.hf_dir), dtype="float32", **CHUNKED)
    g = llm.llm_engine.config.arch.gemma
    assert (g.sliding_layers, g.attn_logit_softcapping) == ((0, 2), ATTN_CAP)
    assert model_runner(llm).captured_decode is None
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(gemma2, reference):
    llm = LLM(model=str(gemma2.f32_gguf), tokenizer=str(gemma2.hf_dir), dtype="float32",
              **CHUNKED)
    arch = llm.llm_engine.config.arch
    assert (arch.sliding_window, arch.gemma.final_logit_softcapping) == (WINDOW, FINAL_CAP)
    check_float32(llm, reference)


def test_q8_0_gguf_runs_its_blocks_through_the_captured_decode(gemma2):
    llm = LLM(model=str(gemma2.q8_0_gguf), tokenizer=str(gemma2.hf_dir), **CHUNKED)
    runner = model_runner(llm)
    assert llm.llm_engine.config.quantization == "gguf"
    assert runner.captured_decode is not None, runner.decode_path
    check_q8_0(llm, gemma2)
    check_captured_equals_loop(llm, gemma2.prompts)  # windows and soft-caps in C++ too


@pytest.mark.parametrize("change", [{"layer_types": ["full_attention"] * 3},
                                    {"attn_logit_softcapping": None},
                                    {"final_logit_softcapping": None}])
def test_the_window_and_the_caps_bind(gemma2, reference, change):
    """Without the window (every layer global), or without either soft-cap, transformers'
    logits differ: the tests above would see a path that drops one."""
    other = hf_reference(tiny_gemma2(**change), gemma2.prompts[-1:], num_tokens=1)
    assert (other.logits[0] - reference.logits[-1]).abs().max() > 0.1
