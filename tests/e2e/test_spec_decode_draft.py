"""Speculative decoding with a draft model (method "draft_model") on real weights: the shipped
SmolLM2 GGUF (Q4_1 blocks) verifies the drafts of the same model's float checkpoint quantized
to int8 at load, a draft that agrees with it most of the time but not always (quantized to int4,
the checkpoint exported from those Q4_1 blocks drafted 124 of 124 tokens right once every row's
attention ran in the same paged kernel, so no rejection was left to test). Greedy output
and logprobs equal decoding without speculation, alone and with stops, penalties, prefix
caching and preemption; a draft of another vocabulary is refused naming both models; the
memory plan holds the draft's weights and its KV cache beside the target's."""
from __future__ import annotations

import dataclasses

import pytest

from pagedllm import LLM
from test_spec_decode_exactness import GREEDY, PROMPTS, SAMPLING_CASES, _same, _stats


def _draft(smollm_hf_dir, **extra) -> dict:
    return {"model": str(smollm_hf_dir), "quantization": "int8", "num_speculative_tokens": 4,
            "min_acceptance_rate": 0.0, **extra}


@pytest.fixture(scope="module")
def drafted(smollm_gguf, smollm_hf_dir):
    return LLM(model=str(smollm_gguf), speculative_config=_draft(smollm_hf_dir), max_num_seqs=8,
               max_model_len=2048)


def test_greedy_equals_plain_decoding_with_drafts_kept_and_rejected(drafted):
    before = _stats(drafted).copy()
    _same(drafted, PROMPTS, GREEDY)
    got = _stats(drafted).since(before)
    assert got.num_accepted_tokens > 0  # drafts were kept ...
    assert got.num_draft_tokens > got.num_accepted_tokens, got  # ... and some rejected
    assert "the draft model's" in drafted.llm_engine.engine_core.executor.decode_path()


def test_composes_with_sampling_options(drafted):
    for params in SAMPLING_CASES:
        _same(drafted, PROMPTS, params)


def test_prefix_cache_after_draft_speculation(drafted, smollm_gguf):
    """A request continuing a drafted one hits its cached blocks and gets a plain engine's
    tokens and logprobs, bit for bit."""
    plain = LLM(model=str(smollm_gguf), max_num_seqs=8, max_model_len=2048)
    results = []
    for llm in (drafted, plain):
        first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
        again = llm.generate([PROMPTS[0] + first.outputs[0].text], GREEDY, use_tqdm=False)[0]
        results.append((first.outputs[0].token_ids, again.outputs[0].token_ids,
                        again.outputs[0].logprobs))
    assert results[0] == results[1]


def test_preemption_with_a_draft_model(smollm_gguf, smollm_hf_dir):
    """Few KV blocks, shared by the target's and the draft's caches: requests are preempted
    mid-speculation and recomputed (the draft forgets them and catches up again); the tokens
    are those of plain decoding."""
    llm = LLM(model=str(smollm_gguf), speculative_config=_draft(smollm_hf_dir),
              num_gpu_blocks_override=48, max_num_seqs=4, enable_prefix_caching=False,
              max_model_len=768)
    prompts = [PROMPTS[0][:600 + 50 * i] for i in range(4)]
    _same(llm, prompts, dataclasses.replace(GREEDY, max_tokens=60), logprobs=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _stats(llm).num_accepted_tokens > 0


def test_the_plan_holds_the_draft_beside_the_target(drafted, smollm_gguf, smollm_hf_dir):
    """The same KV memory holds fewer blocks when each also holds the draft's layers."""
    budget = 128 << 20
    alone = LLM(model=str(smollm_gguf), kv_cache_memory_bytes=budget, max_model_len=1024)
    config = drafted.llm_engine.config
    target_kv = config.arch.num_hidden_layers * 2 * config.arch.num_key_value_heads * \
        config.arch.head_dim * 4
    draft = config.draft
    assert draft is not None and draft.quantization == "int8"
    both = LLM(model=str(smollm_gguf), kv_cache_memory_bytes=budget, max_model_len=1024,
               speculative_config=_draft(smollm_hf_dir))
    per_token = target_kv + draft.arch.num_hidden_layers * 2 * \
        draft.arch.num_key_value_heads * draft.arch.head_dim * 4
    blocks = both.llm_engine.config.cache.num_blocks
    assert blocks == budget // (per_token * config.cache.block_size)
    assert blocks < alone.llm_engine.config.cache.num_blocks


def test_a_draft_of_another_vocabulary_is_refused_naming_both(smollm_gguf, qwen_gguf):
    with pytest.raises(ValueError) as err:
        LLM(model=str(smollm_gguf), max_model_len=512,
            speculative_config={"model": str(qwen_gguf), "num_speculative_tokens": 3})
    message = str(err.value)
    assert str(qwen_gguf) in message and str(smollm_gguf) in message
    assert "vocabulary" in message
