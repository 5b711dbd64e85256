"""Speculative decoding in the scheduler: the config's checks, the n-gram proposer, per-request
draft lengths, drafts in the budget and the KV, rollback of rejected drafts."""
import pytest

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.spec_decode import PAUSE_TOKENS, NgramProposer, Speculator
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.bitmask import bitmask_to_bool
from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.grammar import MaskBudget
from pagedllm.tokenizer.tokenizer import load_tokenizer

EOS = 0
BS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3, "min_acceptance_rate": 0.0}  # a fixed k of 3
ADAPTIVE = {**NGRAM, "min_acceptance_rate": 0.25}  # k from acceptance and cost (the default)


def req(rid, prompt, max_tokens=16, **params):
    return Request(rid, list(prompt), SamplingParams(**params), max_tokens, frozenset({EOS}), BS)


def make(budget=32, num_blocks=32, spec=NGRAM):
    kv = KVCacheManager(num_blocks, BS, True)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(cfg, kv, speculator=Speculator(SpeculativeConfig.from_dict(spec))), kv


def step(s, answer):
    """One step whose target model answers with `answer(rid, drafts)`: the tokens it yields
    (the drafts kept and its own after them), or one token for a plain step."""
    sched = s.schedule()
    out = ModelRunnerOutput(sampled={})
    for rid, n in sched.num_scheduled_tokens.items():
        r = s.requests[rid]
        drafts = sched.spec_token_ids.get(rid)
        if drafts:
            out.spec_token_ids[rid] = answer(rid, drafts)
        elif r.num_computed_tokens + n == r.num_tokens:
            out.sampled[rid] = answer(rid, [])[0]
    return sched, s.update_from_output(sched, out)


# ---- config ------------------------------------------------------------------------------
def test_config_takes_vllms_fields_and_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize("value, words", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, ["speculative_config.model"]),
    ({"model": "x.gguf", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     ["prompt_lookup_max", "'draft_model'"]),
    ({"model": "x.gguf", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     ["draft_tensor_parallel_size=2"]),
    ({"model": "x.gguf", "num_speculative_tokens": 3, "dtype": "int8"}, ["dtype", "bfloat16"]),
    ({"model": "x.gguf"}, ["num_speculative_tokens"]),
    ({"method": "eagle", "num_speculative_tokens": 3}, ["method='eagle'", "EAGLE"]),
    ({"method": "lookahead", "num_speculative_tokens": 3}, ["unknown", "ngram"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
     ["draft_tensor_parallel_size"]),
    ({"method": "ngram"}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, ["prompt_lookup_min", "prompt_lookup_max"]),
    ({"num_speculative_tokens": 2}, ["method"]),
    ("ngram", ["dict"]),
])
def test_config_refusals_name_the_field(value, words):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_dict(value)
    for word in words:
        assert word in str(err.value)


def test_a_model_path_means_a_draft_model():
    c = SpeculativeConfig.from_dict({"model": "d.gguf", "num_speculative_tokens": 3,
                                     "quantization": "int8", "dtype": "float32"})
    assert (c.method, c.model, c.quantization, c.dtype) == ("draft_model", "d.gguf", "int8",
                                                           "float32")
    assert c.uses_draft_model and not SpeculativeConfig.from_dict(NGRAM).uses_draft_model


def test_engine_args_refuse_parallel_ranks():
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineArgs(model="m", speculative_config=NGRAM, pipeline_parallel_size=2)
    assert EngineArgs(model="m", speculative_config=NGRAM).speculative().num_speculative_tokens == 3


# ---- proposer -----------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_match():
    p = NgramProposer(SpeculativeConfig.from_dict(NGRAM))
    # last 3 tokens 7 8 9 occurred at 1..3, followed by 4 5 6; the 2-gram 8 9 also at 10
    r = req("a", [1, 7, 8, 9, 4, 5, 6, 2, 2, 8, 9, 3, 7, 8, 9])
    assert p.propose(r, 3) == [4, 5, 6]
    assert p.propose(r, 1) == [4]
    assert p.propose(req("b", [1, 2, 3, 4, 5]), 3) == []  # no earlier occurrence


def test_ngram_looks_in_the_prediction_first():
    p = NgramProposer(SpeculativeConfig.from_dict(NGRAM))
    r = req("a", [5, 6, 9, 9, 5, 6])
    r.prediction_token_ids = [1, 5, 6, 7, 8]
    assert p.propose(r, 3) == [7, 8]
    r.prediction_token_ids = [1, 2]  # no match there: the context
    assert p.propose(r, 3) == [9, 9, 5]


# ---- scheduling ---------------------------------------------------------------------------
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # the tail "1 2" was followed by 3 4 5


def test_drafts_count_in_the_budget_and_get_slots():
    s, kv = make()
    s.add_request(req("a", PROMPT))
    step(s, lambda rid, d: [3])  # prefill: samples 3 -> tokens end "1 2 3"
    sched, outs = step(s, lambda rid, d: d + [7])  # every draft kept, then 7
    assert sched.spec_token_ids == {"a": [4, 5, 6]}
    assert sched.num_scheduled_tokens == {"a": 4}
    # 11 prompt + 1 sampled + 3 drafts: 15 slots in 4 blocks
    assert len(kv.block_ids("a")) == 4
    assert outs[0].new_token_ids == [4, 5, 6, 7]
    r = s.requests["a"]
    assert (r.num_computed_tokens, r.num_tokens) == (15, 16)


def test_rejected_drafts_are_rolled_back():
    s, kv = make()
    s.add_request(req("a", PROMPT))
    step(s, lambda rid, d: [3])
    sched, outs = step(s, lambda rid, d: [d[0], 9])  # first draft kept, second replaced by 9
    assert sched.spec_token_ids == {"a": [4, 5, 6]}
    assert outs[0].new_token_ids == [4, 9]
    r = s.requests["a"]
    # the last token and one draft have KV; the rejected drafts' positions are computed again
    assert (r.num_computed_tokens, r.num_tokens) == (13, 14)
    stats = s.speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.accepted_per_pos == [1, 0, 0]


def test_prefix_cache_never_holds_a_block_with_drafts():
    s, kv = make()
    s.add_request(req("a", PROMPT))
    step(s, lambda rid, d: [3])
    step(s, lambda rid, d: [9])  # every draft rejected
    r = s.requests["a"]
    assert r.num_computed_tokens == 12 and r.output_token_ids == [3, 9]
    # blocks cached: only whole blocks of known tokens (12 known of 13 -> 3 blocks)
    cached = [b for b in kv.pool.blocks if b.block_hash is not None]
    assert len(cached) == 3 and len(r.block_hashes) == 3


def test_drafts_leave_room_for_max_tokens_and_stop_at_eos():
    s, _ = make()
    s.add_request(req("a", PROMPT, max_tokens=3))
    step(s, lambda rid, d: [3])
    sched, outs = step(s, lambda rid, d: d + [7])
    assert sched.spec_token_ids == {"a": [4]}  # 1 output so far, 2 to go: one draft + one
    assert outs[0].new_token_ids == [4, 7] and outs[0].finish_reason == "length"
    s.add_request(req("b", PROMPT))
    step(s, lambda rid, d: [3])
    sched, outs = step(s, lambda rid, d: [4, EOS])  # stops at EOS: nothing after it
    assert outs[0].new_token_ids == [4, EOS] and outs[0].finish_reason == "stop"
    assert not s.requests and s.kv.pool.num_free_blocks == 32


def test_no_drafts_when_the_blocks_are_not_free():
    s, _ = make(num_blocks=3)  # 12 slots: the prompt and its sampled token only
    s.add_request(req("a", PROMPT))
    step(s, lambda rid, d: [3])
    sched, _ = step(s, lambda rid, d: [4])
    assert sched.spec_token_ids == {} and sched.num_scheduled_tokens == {"a": 1}
    assert s.num_preemptions == 0


def test_draft_length_follows_acceptance_and_low_acceptance_pauses():
    spec = Speculator(SpeculativeConfig.from_dict(ADAPTIVE))
    r = req("a", PROMPT + [3])
    ks = []
    for _ in range(6):  # a cheap probe first, then more as every draft is kept
        ks.append(len(spec.drafts(r, 8)))
        spec.record(r, ks[-1], ks[-1])
    assert ks[0] == 1 and ks == sorted(ks) and ks[-1] == 3
    misses = 0
    while spec.drafts(r, 8) and misses < 10:  # refused again and again: under ~0.37 none pays
        k = len(spec.drafts(r, 8))
        spec.record(r, k, 0)
        misses += 1
        assert len(spec.drafts(r, 8)) <= k  # never more after a refusal
    assert spec.drafts(r, 8) == [] and misses <= 8  # paused for PAUSE_TOKENS output tokens
    r.output_token_ids.extend([7] * (PAUSE_TOKENS - 1))
    assert spec.drafts(r, 8) == []
    r.output_token_ids.extend([1, 2, 3])
    assert spec.drafts(r, 8) == [4]  # then one draft again


def test_pauses_in_a_row_grow_and_a_draft_that_cannot_pay_is_never_asked():
    spec = Speculator(SpeculativeConfig.from_dict(ADAPTIVE))
    r = req("a", PROMPT + [3])
    pauses = []
    for _ in range(3):  # refused at every probe: 32, then 64, then 128 plain tokens
        while spec.drafts(r, 8):
            spec.record(r, len(spec.drafts(r, 8)), 0)
        start = r.num_output_tokens
        while not spec.drafts(r, 8):
            r.output_token_ids.append(7)
        pauses.append(r.num_output_tokens - start)
    assert pauses == [PAUSE_TOKENS, 2 * PAUSE_TOKENS, 4 * PAUSE_TOKENS]
    # a draft model as large as the target: no acceptance could pay for its steps
    same = Speculator(SpeculativeConfig.from_dict(ADAPTIVE), draft_cost=1.0)
    assert same.drafts(req("b", PROMPT + [3]), 8) == []
    forced = Speculator(SpeculativeConfig.from_dict(NGRAM), draft_cost=1.0)
    assert forced.drafts(req("b", PROMPT + [3]), 8) == [4, 5, 6]  # min_acceptance_rate 0


def test_min_acceptance_rate_0_keeps_num_speculative_tokens():
    spec = Speculator(SpeculativeConfig.from_dict({**NGRAM, "min_acceptance_rate": 0.0}))
    r = req("a", PROMPT + [3])
    for _ in range(5):
        assert spec.drafts(r, 8) == [4, 5, 6]
        spec.record(r, 3, 0)


def test_a_costly_row_pauses_sooner():
    """Where a verify row costs as much as a plain step (a compute-bound 7B), a request
    whose drafts are kept 2 times in 3 stops speculating; at the default cost it goes on."""
    for prior, expect_paused in ((0.35, False), (1.0, True)):
        spec = Speculator(SpeculativeConfig.from_dict(ADAPTIVE), draft_cost=prior - 0.35)
        r = req("a", PROMPT + [3])
        for _ in range(6):
            spec.drafts(r, 8)
            spec.record(r, 3, 2)
        assert (spec.drafts(r, 8) == []) == expect_paused


# ---- a draft model: drafts asked for a step ahead, with KV slots for them ------------------
DRAFT = {"model": "draft.gguf", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}


def test_a_draft_model_is_asked_for_drafts_with_slots_ahead():
    s, kv = make(spec=DRAFT)
    s.add_request(req("a", [1, 2, 3, 4, 5, 6], max_tokens=20))
    sched = s.schedule()  # the whole prompt: samples, so the runner drafts 3 after it
    assert sched.draft_lengths == {"a": 3} and not sched.spec_token_ids
    # blocks for the prompt's 6 tokens, the sampled one and the 2 drafts fed after it
    assert len(kv.block_ids("a")) == -(-(6 + 3) // BS)
    out = ModelRunnerOutput(sampled={"a": 7}, draft_token_ids={"a": [8, 9, 10]})
    s.update_from_output(sched, out)
    sched = s.schedule()  # the drafts come back to be verified after token 7
    assert sched.spec_token_ids == {"a": [8, 9, 10]} and sched.num_scheduled_tokens["a"] == 4
    assert sched.draft_lengths == {"a": 3}
    out = ModelRunnerOutput(sampled={}, spec_token_ids={"a": [8, 11]},
                            draft_token_ids={"a": [12, 13]})
    s.update_from_output(sched, out)  # 8 kept, 11 the target's own: computed up to 8
    r = s.requests["a"]
    assert r.output_token_ids == [7, 8, 11] and r.num_computed_tokens == 8
    assert s.speculator.stats.num_accepted_tokens == 1
    assert s.schedule().spec_token_ids == {"a": [12, 13]}  # a fixed k: all it has


def test_a_draft_model_is_not_asked_past_max_tokens_or_without_free_blocks():
    s, _ = make(spec=DRAFT)
    s.add_request(req("a", [1, 2, 3], max_tokens=2))
    sched = s.schedule()  # 2 tokens at most: one now, one next step with no room for drafts
    assert "a" not in sched.draft_lengths
    s, kv = make(spec=DRAFT, num_blocks=2)
    s.add_request(req("b", [1, 2, 3, 4, 5, 6, 7], max_tokens=20))
    sched = s.schedule()  # 7 tokens fill 2 blocks of 4: the drafts' slots are not free
    assert "b" not in sched.draft_lengths and sched.num_scheduled_tokens == {"b": 7}


def test_a_draft_model_reads_the_prompt_chunks_of_a_request_it_will_draft_for():
    s, _ = make(budget=4, spec=DRAFT)
    s.add_request(req("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=20))
    sched = s.schedule()  # 4 of 7 prompt tokens: no sample, the draft reads the chunk (0)
    assert sched.num_scheduled_tokens == {"a": 4} and sched.draft_lengths == {"a": 0}
    s.update_from_output(sched, ModelRunnerOutput(sampled={}))
    sched = s.schedule()  # the last 3: samples, drafts after it
    assert sched.num_scheduled_tokens == {"a": 3} and sched.draft_lengths == {"a": 3}


# ---- structured outputs -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    return load_tokenizer(resolve_checkpoint(smollm_gguf).tokenizer_path)


def constrained(tokenizer):
    """A scheduler with one request under a three-word regex whose prompt repeats "to be or
    not", after its prefill sampled "to": the n-gram drafts " be or not" follow."""
    kv = KVCacheManager(32, BS, True)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    s = Scheduler(cfg, kv, len(tokenizer), Speculator(SpeculativeConfig.from_dict(NGRAM)))
    words = tokenizer.encode("to be or not") * 2
    r = Request("a", words, SamplingParams(temperature=0), 16,
                frozenset({tokenizer.eos_token_id}), BS)
    r.grammar = GrammarCompiler(tokenizer, len(tokenizer)).compile(
        StructuredOutputsParams(regex="[a-z]+( [a-z]+){2}")).new_state()
    s.add_request(r)
    step(s, lambda rid, d: words[:1])
    return s, words[1:4]  # " be", " or", " not"


def test_constrained_drafts_are_cut_by_the_grammar_with_a_mask_row_each(tokenizer):
    s, (be, or_, not_) = constrained(tokenizer)
    eos = tokenizer.eos_token_id
    sched, outs = step(s, lambda rid, d: d + [eos])
    assert sched.spec_token_ids == {"a": [be, or_]}  # " not" would be a fourth word
    assert sched.num_scheduled_tokens == {"a": 3}
    assert sched.grammar.req_ids == ["a"] * 3  # after "to", after " be", after " or"
    allowed = bitmask_to_bool(sched.grammar.bitmask, len(tokenizer))
    assert allowed[0, be] and allowed[1, or_] and not allowed[2, not_] and allowed[2, eos]
    assert not allowed[0, eos] and not allowed[1, eos]  # fewer than three words
    # the grammar accepted each kept token once, at the update: the answer is complete
    assert outs[0].new_token_ids == [be, or_, eos] and outs[0].finish_reason == "stop"


def test_drafts_past_the_mask_budget_are_dropped_not_the_request(tokenizer, monkeypatch):
    s, (be, or_, _) = constrained(tokenizer)
    rooms = []
    monkeypatch.setattr(MaskBudget, "draft_room",  # room for one draft's mask per step
                        lambda self, bitmask: rooms.append(bitmask) or len(rooms) == 1)
    sched, outs = step(s, lambda rid, d: d + [or_])
    assert sched.spec_token_ids == {"a": [be]} and sched.num_scheduled_tokens == {"a": 2}
    assert sched.grammar.req_ids == ["a"] * 2 and sched.grammar.bitmask.shape[0] == 2
    assert outs[0].new_token_ids == [be, or_] and outs[0].finish_reason is None
    r = s.requests["a"]
    assert (r.num_computed_tokens, r.num_tokens) == (10, 11)  # 8 + "to" + 2
