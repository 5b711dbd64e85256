"""kv_cache_dtype="bfloat16" on the CPU: the default model's GGUF (float32 compute) with its KV
cache in bf16, half the bytes. Keys and values are rounded once, as they are written, and every
read sees the rounded values: the paged decode attention, a prompt chunk over its cached
prefix, and a prompt's own first chunk (rounded the same way before its attention). Against the
float32 cache: the same greedy tokens up to a near-tie, log-probabilities within 0.15."""
from __future__ import annotations

import pytest
import torch

from helpers import model_runner
from pagedllm import LLM, SamplingParams

PROMPTS = [
    "def quicksort(arr):",
    "The three primary colors are",
    "Write a haiku about the sea.\n",
]
ENGINE = dict(max_model_len=512, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
# measured over 12 tokens of the three prompts on a Zen 4: 0.085 at most with the prompts' attention
# in SDPA, 0.111 (the first token of the first prompt; the rest 0.059) with it in the paged kernel
NEAR_FLOAT32 = 0.15


def _run(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def bf16_cache(qwen_gguf):
    llm = LLM(model=str(qwen_gguf), kv_cache_dtype="bfloat16", **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def f32_cache(qwen_gguf):
    llm = LLM(model=str(qwen_gguf), **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_the_cache_is_bf16_at_half_the_bytes(bf16_cache, f32_cache):
    bf16, f32 = model_runner(bf16_cache), model_runner(f32_cache)
    assert bf16.kv_cache.dtype == torch.bfloat16 and f32.kv_cache.dtype == torch.float32
    assert bf16.config.dtype == torch.float32  # the compute dtype is unchanged
    # the blocks this engine needs (max_model_len x max_num_seqs), half the bytes
    assert bf16.kv_cache.shape == f32.kv_cache.shape
    assert 2 * bf16.kv_cache.nbytes == f32.kv_cache.nbytes


def test_near_the_float32_cache(bf16_cache, f32_cache):
    for (tokens, lps), (want_tokens, want_lps) in zip(_run(bf16_cache, PROMPTS),
                                                      _run(f32_cache, PROMPTS)):
        for i, (token, want) in enumerate(zip(tokens, want_tokens)):
            if token != want:  # only where the float32 cache's two best were close
                assert want_lps[i][want] - want_lps[i].get(token, -1e9) <= 2 * NEAR_FLOAT32
                break
            assert abs(lps[i][token] - want_lps[i][token]) <= NEAR_FLOAT32, i


@pytest.mark.parametrize("cache", ["bf16_cache", "f32_cache"])
def test_a_prefix_cache_hit_gives_the_fresh_prompts_numbers(cache, request):
    """A prompt fresh, then again alone and inside a batch with its full blocks from the prefix
    cache (its tail chunk reading the cached prefix): the same tokens and log-probabilities to
    the bit, with either cache. The CPU backend runs short prompt chunks through the paged
    kernel one row at a time (attention/backends/cpu.py), so the tail chunk's rows compute what
    the fresh prompt's did; under SDPA, whose shapes differed, the kept blocks' 8-bit
    activations turned the last bits into rounding steps (0.04 apart with a float32 cache, 0.1
    with bf16). That a prompt's own keys and values are rounded before its attention, as every
    later read sees them, is tested on the backend (tests/attention/test_backends.py)."""
    llm = request.getfixturevalue(cache)
    prompt = PROMPTS[2] + "Waves " * 40  # > 2 blocks of 16 tokens
    fresh = _run(llm, [prompt])[0]
    for batch, at in (([prompt], 0), ([PROMPTS[0], prompt, PROMPTS[1]], 1)):
        hits = llm.llm_engine.engine_core.kv_manager.prefix_hits
        again = _run(llm, batch)[at]
        assert llm.llm_engine.engine_core.kv_manager.prefix_hits >= hits + 32
        assert again == fresh
