"""Engine behaviour on the real SmolLM2 weights: batching, preemption, caching, sampling, stops."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "In the beginning of the universe there was nothing but a vast expanse of darkness and",
    "def add(a, b):\n    return",
    "Water boils at",
]


# These tests compare token sequences across batch shapes. They run the float32 path
# (quantization="none"), whose numbers do not depend on the batch, so that they test the engine
# apart from the block kernels; the kept blocks are batch-invariant too (tests/e2e/test_quantized.py).
@pytest.fixture(scope="module")
def llm(smollm_gguf):
    return LLM(model=str(smollm_gguf), dtype="float32", max_num_seqs=16, quantization="none")


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _all_blocks_free(llm) -> bool:
    pool = llm.llm_engine.engine_core.kv_manager.pool
    return pool.num_free_blocks == pool.num_blocks


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens when run on its own."""
    return [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]


def test_batch_equals_alone(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == alone
    tok = llm.get_tokenizer()
    for out in outs:  # incremental detokenization ends at the same text as a full decode
        comp = out.outputs[0]
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
    assert _all_blocks_free(llm)


def test_requests_joining_mid_flight(llm, alone):
    engine = llm.llm_engine
    results = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"j{i}", prompt, GREEDY)
        for _ in range(3 + i):  # let the earlier ones run a few steps before the next joins
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert [results[f"j{i}"] for i in range(len(PROMPTS))] == alone
    assert _all_blocks_free(llm)


def test_chunked_prefill_and_preemption_keep_outputs(smollm_gguf, llm, alone):
    # 8 blocks of 16 tokens: four ~40-token sequences cannot all fit, so some are preempted;
    # a 16-token budget splits the long prompt into chunks
    small = LLM(model=str(smollm_gguf), dtype="float32", num_gpu_blocks_override=8,
                quantization="none",
                max_num_batched_tokens=16, max_model_len=128)
    assert _tokens(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _all_blocks_free(small)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    assert (_tokens(small.generate(PROMPTS, seeded, use_tqdm=False))
            == _tokens(llm.generate(PROMPTS, seeded, use_tqdm=False)))
    # prompt logprobs come back once per prompt position even when chunked and recomputed
    with_lp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    before = small.llm_engine.engine_core.scheduler.num_preemptions
    chunked = small.generate(PROMPTS, with_lp, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > before
    for got, ref in zip(chunked, llm.generate(PROMPTS, with_lp, use_tqdm=False)):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20,
                       ignore_eos=True)
    first = _tokens(llm.generate(PROMPTS[:1], p, use_tqdm=False))[0]
    again = _tokens(llm.generate(PROMPTS[:1], p, use_tqdm=False))[0]
    other = SamplingParams(temperature=1.0, max_tokens=20)
    in_batch = llm.generate(PROMPTS, [p, other, other, other], use_tqdm=False)
    assert first == again == in_batch[0].outputs[0].token_ids


def test_prefix_cache_hit_gives_same_output(llm):
    prompt = PROMPTS[1] * 3  # > 2 blocks
    a = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    kv = llm.llm_engine.engine_core.kv_manager
    hits_before = kv.prefix_hits
    b = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert kv.prefix_hits - hits_before >= 32
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_n_samples_stop_strings_and_limits(llm):
    outs = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=3,
                                                             max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    samples = outs[0].outputs
    assert [s.index for s in samples] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert all(len(s.token_ids) == 12 and s.finish_reason == "length" for s in samples)

    base = llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0]
    word = base.text.split()[2]
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0, max_tokens=24, stop=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert word not in out.text and base.text.startswith(out.text)
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0, max_tokens=24, stop=[word],
                                      include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.endswith(word)
    stop_tok = base.token_ids[3]
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:4] and out.stop_reason == stop_tok
    assert _all_blocks_free(llm)


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely token
        assert 3 <= len(lp) <= 4
    assert comp.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lp and len(lp) <= 3


def test_chat_uses_the_model_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt_token_ids[:1] == llm.get_tokenizer().encode("<|im_start|>")
    assert out.outputs[0].text.strip()


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens long but max_model_len is"):
        llm.generate(["hi " * 9000], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [10 ** 9]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(["a"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be <= 20"):
        llm.generate(["a"], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "x"}], use_tqdm=False)
    assert _all_blocks_free(llm) and not llm.llm_engine.has_unfinished_requests()


def test_gpu_only_arguments_warn_and_unknown_ones_fail(smollm_gguf, caplog):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model=str(smollm_gguf), no_such_option=1)
    with caplog.at_level("WARNING", logger="pagedllm"):
        llm = LLM(model=str(smollm_gguf), gpu_memory_utilization=0.9, enforce_eager=True,
                  swap_space=4, max_model_len=256)
    assert "gpu_memory_utilization" in caplog.text and "swap_space" in caplog.text
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
