"""Gemma 3 (text) against transformers (eager attention): a tiny random model of four layers,
local / global / local / global (sliding_window_pattern 2), whose sliding window (8) is
shorter than every prompt but the first; per-head q/k norms; the local layers turning by their
own RoPE base (100) and the global ones by another (10000) with linear scaling (factor 2), so
that one table for both, or a scaled local table, gives other logits; the final logits
soft-capped. Through the HF directory and float32 / Q8_0 GGUFs, batched, with chunked prefill
and the prefix cache on."""
from __future__ import annotations

import gguf
import pytest
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from e2e.helpers import model_runner
from pagedllm import LLM
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gemma_arch import gemma_from_gguf
from pagedllm.loader.hf.arch import arch_from_hf_config
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, gguf_tensors, gemma_init, hf_reference, prompts,
                         save_checkpoints)

WINDOW, PATTERN = 8, 2
LOCAL_BASE, GLOBAL_BASE, GLOBAL_FACTOR = 100.0, 10000.0, 2.0
FINAL_CAP = 1.0


def rope_parameters(local_base: float = LOCAL_BASE) -> dict:
    """transformers 5's Gemma 3 RoPE: one set per layer type."""
    return {"sliding_attention": {"rope_type": "default", "rope_theta": local_base},
            "full_attention": {"rope_type": "linear", "factor": GLOBAL_FACTOR,
                               "rope_theta": GLOBAL_BASE}}


def gemma3_fields(writer, cfg) -> None:
    """The gemma3 GGUF keys llama.cpp's converter writes (the global layers' RoPE scaling and
    base, the local ones' base), and the layer pattern, which llama.cpp reads when present
    (else 6) and its converter leaves out."""
    base_fields(writer, cfg)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(GLOBAL_FACTOR)
    writer.add_rope_freq_base_swa(LOCAL_BASE)
    writer.add_sliding_window_pattern(PATTERN)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The tiny Gemma 3 as an HF directory and float32 / Q8_0 GGUFs (norms, q/k norms too,
    stored as 1 + w, as llama.cpp's converter writes them)."""
    model = tiny_gemma3()
    cfg = model.config
    norms = {name: arr + 1 for name, arr in gguf_tensors(model, gguf.MODEL_ARCH.GEMMA3).items()
             if name.endswith("norm.weight")}
    return save_checkpoints(model, tmp_path_factory.mktemp("gemma3"), "gemma3",
                            lambda w: gemma3_fields(w, cfg), prompts((5, 23, 40, 61), seed=1),
                            extra=norms)


def tiny_gemma3(**changes) -> Gemma3ForCausalLM:
    """The tiny random Gemma 3, its config changed by `changes`; weights as tiny_gemma2's."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, sliding_window=WINDOW, sliding_window_pattern=PATTERN,
                  tie_word_embeddings=True, final_logit_softcapping=FINAL_CAP,
                  rope_parameters=rope_parameters(), attn_implementation="eager")
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**fields, **changes})).eval()
    gemma_init(model)
    return model


@pytest.fixture(scope="module")
def reference(gemma3):
    assert gemma3.model.config._attn_implementation == "eager"
    assert gemma3.model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    return hf_reference(gemma3.model, gemma3.prompts)


def test_hf_directory_matches_transformers(gemma3, reference):
    llm = LLM(model=str(gemma3.hf_dir), dtype="float32", **CHUNKED)
    arch = llm.llm_engine.config.arch
    g = arch.gemma
    assert (g.sliding_layers, g.rope_local_base_freq, g.attn_logit_softcapping) == (
        (0, 2), LOCAL_BASE, None)
    assert (arch.qk_norm, arch.rope_theta) == (True, GLOBAL_BASE)
    assert arch.rope_scaling["factor"] == GLOBAL_FACTOR
    assert model_runner(llm).captured_decode is None
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(gemma3, reference):
    llm = LLM(model=str(gemma3.f32_gguf), tokenizer=str(gemma3.hf_dir), dtype="float32",
              **CHUNKED)
    arch = llm.llm_engine.config.arch
    assert (arch.sliding_window, arch.gemma.sliding_layers) == (WINDOW, (0, 2))
    assert (arch.gemma.rope_local_base_freq, arch.gemma.final_logit_softcapping) == (
        LOCAL_BASE, FINAL_CAP)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": GLOBAL_FACTOR}
    check_float32(llm, reference)


def test_q8_0_gguf_runs_its_blocks_through_the_captured_decode(gemma3):
    llm = LLM(model=str(gemma3.q8_0_gguf), tokenizer=str(gemma3.hf_dir), **CHUNKED)
    assert llm.llm_engine.config.quantization == "gguf"
    assert model_runner(llm).captured_decode is not None
    check_q8_0(llm, gemma3)
    check_captured_equals_loop(llm, gemma3.prompts)  # both RoPE tables, (1 + w) q/k norms


@pytest.mark.parametrize("change", [{"rope_parameters": rope_parameters(GLOBAL_BASE)},
                                    {"layer_types": ["full_attention"] * 4},
                                    {"final_logit_softcapping": None}])
def test_the_local_base_the_window_and_the_cap_bind(gemma3, reference, change):
    """With the global base on the local layers, without the window (every layer global) or
    without the final soft-cap, transformers' logits differ: the tests above would see a path
    that drops one."""
    other = hf_reference(tiny_gemma3(**change), gemma3.prompts[-1:], num_tokens=1)
    assert (other.logits[0] - reference.logits[-1]).abs().max() > 0.1


def test_legacy_rope_keys_and_the_default_pattern(tmp_path):
    """Hub configs hold rope_theta / rope_local_base_freq / rope_scaling and only
    sliding_window_pattern (6: five local layers, then a global one)."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "max_position_embeddings": 256, "sliding_window": 512,
           "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    arch = arch_from_hf_config(cfg)
    assert arch.gemma.sliding_layers == (0, 1, 2, 3, 4, 6, 7)
    assert (arch.rope_theta, arch.gemma.rope_local_base_freq) == (1e6, 1e4)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.gemma.query_pre_attn_scalar == 256


@pytest.mark.parametrize("cfg", [{"architectures": ["Gemma3ForConditionalGeneration"]},
                                 {"model_type": "gemma3", "text_config": {}}])
def test_multimodal_gemma3_is_refused(cfg):
    with pytest.raises(ModelFileError, match="only the text model is supported: "
                                             "Gemma3ForCausalLM"):
        arch_from_hf_config(cfg)


def test_gguf_layer_pattern_as_llama_cpp_reads_it():
    """No window: every layer global; else the pattern as a period (default 6, its last layer
    global) or one flag per layer; the local base 10000 and no soft-caps unless written."""
    def gemma(fields, num_layers=8):
        return gemma_from_gguf(fields, "gemma3", num_layers, 64, 4, 32, "tiny.gguf")

    window = {"gemma3.attention.sliding_window": 512}
    assert gemma({}).sliding_layers == ()
    g = gemma(window)
    assert g.sliding_layers == (0, 1, 2, 3, 4, 6, 7)
    assert (g.rope_local_base_freq, g.attn_logit_softcapping, g.final_logit_softcapping,
            g.query_pre_attn_scalar) == (10000.0, None, None, 32.0)
    flags = {**window, "gemma3.attention.sliding_window_pattern": (True, False, True)}
    assert gemma(flags, num_layers=3).sliding_layers == (0, 2)
    with pytest.raises(ModelFileError, match="sliding_window_pattern must hold one bool per"):
        gemma(flags, num_layers=4)
