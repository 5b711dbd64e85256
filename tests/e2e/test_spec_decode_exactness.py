"""Speculative decoding (n-gram) on the real shipped GGUFs: greedy output and logprobs equal
decoding without it, token for token, alone and composed with stops, penalties, min/max tokens,
structured outputs (drafts checked against the grammar), preemption and prefix caching."""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core import scheduler as scheduler_module
from pagedllm.sampling_params import StructuredOutputsParams

# a fixed k of 4 (min_acceptance_rate 0: vLLM's behaviour), so that every verify carries as
# many drafts as the text allows and drafts are both kept and refused in short generations;
# the adaptive k (the default) is tested in tests/core/test_spec_decode.py and test_spec_cost.py
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "min_acceptance_rate": 0.0}
_CODE = Path(__file__).resolve().parents[2] / "pagedllm" / "core" / "kv_cache_manager.py"
# a prompt whose answer repeats it (drafts are accepted), one that does not, a short one
PROMPTS = ["Repeat this code exactly.\n\n" + _CODE.read_text()[:1500] + "\n\nRepeated:\n",
           "The three largest cities of France are",
           "def fib(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, logprobs=2)


@contextlib.contextmanager
def no_speculation(llm: LLM) -> Iterator[None]:
    """The same engine (weights, cache, batch) with its speculator off: the reference."""
    scheduler = llm.llm_engine.engine_core.scheduler
    speculator, scheduler.speculator = scheduler.speculator, None
    try:
        yield
    finally:
        scheduler.speculator = speculator


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.speculator.stats


def _same(llm: LLM, prompts, params, logprobs: bool = True) -> int:
    """Generate with and without speculation; the outputs must agree exactly (tokens, text,
    finish reasons, and logprobs bit for bit unless told not to); the drafts kept."""
    before = _stats(llm).num_accepted_tokens
    spec = llm.generate(prompts, params, use_tqdm=False)
    accepted = _stats(llm).num_accepted_tokens - before
    with no_speculation(llm):
        plain = llm.generate(prompts, params, use_tqdm=False)
    for s, p in zip(spec, plain):
        a, b = s.outputs[0], p.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason)
        assert a.logprobs == b.logprobs or not logprobs
    return accepted


@pytest.fixture(scope="module")
def smollm(smollm_gguf):
    return LLM(model=str(smollm_gguf), speculative_config=NGRAM, max_num_seqs=8)


@pytest.mark.parametrize("model", ["qwen_gguf", "smollm_gguf"])
def test_greedy_equals_plain_decoding(model, request):
    llm = LLM(model=str(request.getfixturevalue(model)), speculative_config=NGRAM)
    assert _same(llm, PROMPTS, GREEDY) > 0  # drafts were kept, not only proposed
    stats = _stats(llm)
    assert stats.num_drafts > 0 and stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]


# the sampling options speculation must compose with (the draft-model tests use them too)
SAMPLING_CASES = [
    dataclasses.replace(GREEDY, stop=["return"], include_stop_str_in_output=True),
    dataclasses.replace(GREEDY, max_tokens=7),
    dataclasses.replace(GREEDY, min_tokens=30, repetition_penalty=1.3,
                        frequency_penalty=0.4, presence_penalty=0.2),
    dataclasses.replace(GREEDY, logit_bias={198: -5.0}, stop_token_ids=[28]),
    SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=40),  # drawn, one candidate
]


def test_composes_with_sampling_options(smollm):
    for params in SAMPLING_CASES:
        _same(smollm, PROMPTS, params)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
# a prompt, its constraint, and a prediction made from its answer with a part the grammar refuses
CONSTRAINED = [
    ("A person: Bob Smith, 30 years old, lives in Paris. As JSON:", StructuredOutputsParams(
        json=SCHEMA), lambda answer: answer.replace("30", '"thirty"')),
    ("say four words: to be or not to be or not to be or", StructuredOutputsParams(
        regex=r"[a-z]+( [a-z]+){3}"), lambda answer: answer[:8] + "!" + answer[8:]),
    ("Is Paris the capital of France? Answer:", StructuredOutputsParams(
        choice=["yes, it is the capital", "no, it is not the capital"]),
     lambda answer: answer.replace(" is", " is not")),
]


@pytest.mark.parametrize("model", ["qwen_gguf", "smollm_gguf"])
def test_structured_outputs_are_speculated_exactly(model, request, smollm, monkeypatch):
    """A JSON schema, a regex and a choice speculated in a batch beside a free request, each
    with a prediction that is its answer with a part its grammar refuses: each one's drafts
    are checked against its grammar (some kept, some refused), and tokens, text and logprobs
    equal decoding without speculation, bit for bit."""
    llm = smollm if model == "smollm_gguf" else LLM(
        model=str(request.getfixturevalue(model)), speculative_config=NGRAM)
    prompts = [prompt for prompt, _, _ in CONSTRAINED] + PROMPTS[:1]
    params = [dataclasses.replace(GREEDY, structured_outputs=so) for _, so, _ in CONSTRAINED]
    with no_speculation(llm):  # the answers; both runs below then find the same prefix cache
        answers = llm.generate(prompts, params + [GREEDY], use_tqdm=False)
    params = [dataclasses.replace(p, prediction=depart(a.outputs[0].text))
              for p, a, (_, _, depart) in zip(params, answers, CONSTRAINED)] + [GREEDY]
    assert all(p.prediction != a.outputs[0].text for p, a in zip(params, answers))

    def kind(r) -> str:
        constraint = r.sampling_params.structured_outputs
        return "free" if constraint is None else constraint.kind

    speculator = llm.llm_engine.engine_core.scheduler.speculator
    kept, refused = Counter(), Counter()
    record, allowed = speculator.record, scheduler_module.grammar_allowed

    def counting_record(r, num_drafts, num_accepted):
        kept[kind(r)] += num_accepted
        record(r, num_drafts, num_accepted)

    def counting_allowed(r, drafts):
        checked = allowed(r, drafts)
        refused[kind(r)] += len(drafts) - len(checked)
        return checked

    monkeypatch.setattr(speculator, "record", counting_record)
    monkeypatch.setattr(scheduler_module, "grammar_allowed", counting_allowed)
    _same(llm, prompts, params)
    assert all(kept[k] > 0 for k in ("json", "regex", "choice", "free")), kept
    assert all(refused[k] > 0 for k in ("json", "regex", "choice")), refused


def test_prefix_cache_after_speculation(smollm, smollm_gguf):
    """A request that continues a speculated one finds its blocks cached (those of its
    output too) and gets what a plain engine doing the same gets, logprobs bit for bit: no
    cached block holds a rejected draft's keys and values."""
    plain = LLM(model=str(smollm_gguf), max_num_seqs=8)
    results = []
    for llm in (smollm, plain):
        first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
        kv = llm.llm_engine.engine_core.kv_manager
        hits = kv.prefix_hits
        again = llm.generate([PROMPTS[0] + first.outputs[0].text], GREEDY, use_tqdm=False)[0]
        assert kv.prefix_hits - hits > len(first.prompt_token_ids)  # output blocks hit too
        results.append((first.outputs[0].token_ids, again.outputs[0].token_ids,
                        again.outputs[0].logprobs))
    assert results[0] == results[1]


def test_seeded_sampling_is_reproducible(smollm):
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=40)
    one = smollm.generate(PROMPTS, params, use_tqdm=False)
    two = smollm.generate(PROMPTS[:1], params, use_tqdm=False)  # another batch
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids


def test_preemption(smollm_gguf):
    """Few KV blocks: requests are preempted and recomputed mid-speculation. A recompute
    prefills what was decoded (the prompt path's float sums, not the decode step's), and the
    two runs are preempted at different steps, so their logprobs differ in the last digits;
    the tokens do not."""
    llm = LLM(model=str(smollm_gguf), speculative_config=NGRAM, num_gpu_blocks_override=48,
              max_num_seqs=4, enable_prefix_caching=False)
    prompts = [PROMPTS[0][:600 + 50 * i] for i in range(4)]
    _same(llm, prompts, dataclasses.replace(GREEDY, max_tokens=60), logprobs=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_prediction_is_the_ngram_source(smollm):
    """OpenAI's predicted output: the expected text is searched first, so an answer that
    does not repeat its prompt is still drafted from it; the output is unchanged."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with no_speculation(smollm):
        expected = smollm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    before = _stats(smollm).num_accepted_tokens
    got = smollm.generate([prompt], dataclasses.replace(params, prediction=expected.text),
                          use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert _stats(smollm).num_accepted_tokens - before >= 20


def test_prediction_needs_speculation(smollm_gguf):
    llm = LLM(model=str(smollm_gguf), max_num_seqs=2)
    with pytest.raises(ValueError, match="prediction.*speculative_config"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, prediction="hello"), use_tqdm=False)


def test_lora_adapters_with_speculation(smollm_gguf, smollm_lora_adapters):
    """A batch mixing two adapters and the base, speculated: each row of a verify pass takes its
    request's adapter, so tokens and logprobs are those of plain decoding, bit for bit."""
    llm = LLM(model=str(smollm_gguf), speculative_config=NGRAM, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=1024)
    loras = [smollm_lora_adapters[0], None, smollm_lora_adapters[1]]
    prompts = [PROMPTS[0]] * 3
    before = _stats(llm).num_accepted_tokens
    spec = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert _stats(llm).num_accepted_tokens > before  # the adapters' rows were verified
    with no_speculation(llm):
        plain = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in spec] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in plain]
    # the adapters change what is computed (their logprobs differ from the base's)
    assert spec[0].outputs[0].logprobs != spec[1].outputs[0].logprobs


@pytest.mark.parametrize("variant", ["avx512vnni", "avxvnni", "avx512bw", "avx2", "generic"])
def test_greedy_equals_plain_decoding_on_every_kernel_variant(smollm, variant):
    """The kept-block kernels forced to each instruction-set variant this CPU runs (skipped,
    naming the missing feature, where it cannot): speculated greedy output equals plain
    decoding in that variant, and so do the logprobs, bit for bit, in the SIMD variants (each
    makes the same float updates per row at every batch size); the generic variant (CPUs
    without AVX2) rounds a verify's rows differently from a single row (seen: 4e-7), so its logprobs
    agree to ~1e-6, not bit for bit."""
    import torch

    ops = torch.ops.pagedllm
    chosen = ops.kernel_isa()[0]
    try:
        ops.set_kernel_isa(variant)
    except RuntimeError as err:
        pytest.skip(str(err).splitlines()[0])
    try:
        before = _stats(smollm).num_drafts
        _same(smollm, PROMPTS[:2], dataclasses.replace(GREEDY, max_tokens=24),
              logprobs=variant != "generic")
        assert _stats(smollm).num_drafts > before  # verify passes ran in this variant
    finally:
        ops.set_kernel_isa(chosen)
