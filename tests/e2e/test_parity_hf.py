"""Greedy tokens and logits of pagedllm equal HF transformers on the real shipped checkpoints."""
from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

from pagedllm.layers.ggml_linear import GGMLEmbedding
from pagedllm.platforms.malloc import trim_freed_memory

from helpers import last_logits, model_runner, parity_prompts

NUM_TOKENS = 32
MODELS = ["smollm", "qwen"]


@pytest.fixture(scope="module", params=MODELS)
def reference(request, smollm_hf_dir, qwen_hf_dir):
    """(HF dir, HF model in float32, prompts, HF greedy tokens and last logits per prompt)."""
    hf_dir = {"smollm": smollm_hf_dir, "qwen": qwen_hf_dir}[request.param]
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                              local_files_only=True).eval()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    prompts = parity_prompts(tok)
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            logits.append(hf(ids).logits[0, -1].float())
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                              do_sample=False)
            tokens.append(out[0, ids.shape[1]:].tolist())
    del hf
    gc.collect()
    trim_freed_memory()  # before the tests load pagedllm's float32 copy
    return request.param, hf_dir, prompts, tokens, logits


def _check_llm(llm, prompts, ref_tokens, ref_logits, num_tokens=NUM_TOKENS, logits_tol=1e-3):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens),
                        use_tqdm=False)
    for prompt, out, ref in zip(prompts, outs, ref_tokens):
        assert out.outputs[0].token_ids == ref[:num_tokens], prompt
    if logits_tol is not None:
        for out, ref in zip(outs, ref_logits):
            got = last_logits(llm, out.prompt_token_ids)
            assert (got - ref).abs().max().item() < logits_tol


def test_gguf_float32_matches_hf(reference, smollm_gguf, qwen_gguf):
    name, _, prompts, tokens, logits = reference
    gguf = {"smollm": smollm_gguf, "qwen": qwen_gguf}[name]
    # quantization="none": the blocks dequantized to float32, as transformers loads a GGUF
    llm = LLM(model=str(gguf), dtype="float32", quantization="none")
    _check_llm(llm, prompts, tokens, logits)
    # the embedding keeps its blocks where the head does not share it (Qwen's GGUF has its own
    # output.weight; SmolLM2's head is tied): the lookup is exact, only the memory changes
    embed = model_runner(llm).model.model.embed_tokens
    assert isinstance(embed, GGMLEmbedding) == (name == "qwen")
    assert llm.llm_engine.engine_core.kv_manager.pool.num_free_blocks == llm.llm_engine.engine_core.kv_manager.pool.num_blocks


def test_hf_directory_matches_hf(reference):
    name, hf_dir, prompts, tokens, logits = reference
    if name == "qwen":
        # in float32 the default model's 2.5 GB of weights would set the suite's peak memory
        # (3.2 GiB); its float32 numerics are checked through the GGUF above (the same model
        # code) and every tensor the HF directory loads in tests/loader
        llm = LLM(model=str(hf_dir), dtype="bfloat16")
        _check_llm(llm, prompts, tokens, None, num_tokens=8, logits_tol=None)
        return
    llm = LLM(model=str(hf_dir), dtype="float32")
    _check_llm(llm, prompts, tokens, logits)


def test_bfloat16_first_tokens_match(reference, smollm_gguf, qwen_gguf):
    name, _, prompts, tokens, _ = reference
    gguf = {"smollm": smollm_gguf, "qwen": qwen_gguf}[name]
    llm = LLM(model=str(gguf), dtype="bfloat16", quantization="none")
    _check_llm(llm, prompts, tokens, None, num_tokens=8, logits_tol=None)
