"""SmolLM3 against transformers: a tiny random model with grouped-query attention, tied
embeddings and a NoPE layer (the 4th, as no_rope_layer_interval 4 and llama.cpp place it),
through the HF directory and GGUFs (float32 and Q8_0; Q/K rows in llama.cpp's order), batched,
with chunked prefill and the prefix cache on."""
from __future__ import annotations

import pytest
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.hf.arch import arch_from_hf_config
from tiny_models import (CHUNKED, VOCAB, base_fields, check_captured_equals_loop, check_float32,
                         check_q8_0, hf_reference, prompts, random_init, save_checkpoints)

HEADS, KV_HEADS = 4, 2


def tiny_smollm3(**change) -> SmolLM3ForCausalLM:
    """The tiny SmolLM3 with seed-0 weights; change: config fields to override."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  pad_token_id=None, bos_token_id=None, eos_token_id=VOCAB - 1)
    model = SmolLM3ForCausalLM(SmolLM3Config(**{**fields, **change})).eval()
    random_init(model, seed=0, scale=0.2)
    return model


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """The tiny SmolLM3 as an HF directory and float32 / Q8_0 GGUFs."""
    model = tiny_smollm3()
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    return save_checkpoints(model, tmp_path_factory.mktemp("smollm3"), "smollm3",
                            lambda w: base_fields(w, model.config),
                            prompts((9, 37, 58, 80), seed=1), permute_heads=(HEADS, KV_HEADS))


@pytest.fixture(scope="module")
def reference(smollm3):
    return hf_reference(smollm3.model, smollm3.prompts)


def test_hf_directory_matches_transformers(smollm3, reference):
    llm = LLM(model=str(smollm3.hf_dir), dtype="float32", **CHUNKED)
    arch = llm.llm_engine.config.arch
    assert (arch.architecture, arch.nope_layers, arch.tie_word_embeddings) == ("smollm3", (3,),
                                                                               True)
    check_float32(llm, reference)


def test_float32_gguf_matches_transformers(smollm3, reference):
    llm = LLM(model=str(smollm3.f32_gguf), tokenizer=str(smollm3.hf_dir), dtype="float32",
              **CHUNKED)
    assert llm.llm_engine.config.arch.nope_layers == (3,)
    check_float32(llm, reference)


def test_q8_0_gguf_runs_its_blocks_through_the_captured_decode(smollm3):
    llm = LLM(model=str(smollm3.q8_0_gguf), tokenizer=str(smollm3.hf_dir), **CHUNKED)
    runner = model_runner(llm)
    assert llm.llm_engine.config.quantization == "gguf"
    assert runner.captured_decode is not None, runner.decode_path
    check_q8_0(llm, smollm3)
    check_captured_equals_loop(llm, smollm3.prompts)  # the NoPE layer unturned in C++ too


def test_the_nope_layer_binds(smollm3, reference):
    """With RoPE on every layer transformers' logits differ: the tests above would see a path
    that turns q and k on the NoPE layer."""
    other = hf_reference(tiny_smollm3(no_rope_layers=[1, 1, 1, 1]), smollm3.prompts[-1:],
                         num_tokens=1)
    assert (other.logits[0] - reference.logits[-1]).abs().max() > 0.1


def test_no_rope_layers_as_transformers_reads_them():
    base = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
            "max_position_embeddings": 256}
    assert arch_from_hf_config(base).nope_layers == (3, 7)
    assert arch_from_hf_config({**base, "no_rope_layer_interval": 3}).nope_layers == (2, 5)
    flags = [0, 1, 1, 0, 1, 1, 1, 1]
    assert arch_from_hf_config({**base, "no_rope_layers": flags}).nope_layers == (0, 3)
    with pytest.raises(ModelFileError, match="no_rope_layers must be a list of 0/1 flags"):
        arch_from_hf_config({**base, "no_rope_layers": [1, 0]})
    window = {**base, "sliding_window": 32}
    assert arch_from_hf_config(window).sliding_window is None  # use_sliding_window off
    on = arch_from_hf_config({**window, "use_sliding_window": True})  # its NoPE layers slide
    assert [on.layer_window(i) for i in range(8)] == [None, None, None, 32] * 2
