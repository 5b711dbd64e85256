"""Structured outputs end to end on the real SmolLM2 model: every output matches its spec, at
n = 3 with random sampling, in batches mixed with free requests, and through preemption."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams as SO

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3}}}
PROMPTS = ["Describe a person as JSON.", "Here is some data:", "def f(x):", "Once upon a time"]
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
GRAMMAR = 'root ::= ("yes" | "no") ", because " [a-z]+ "."'


@pytest.fixture(scope="module")
def llm(smollm_gguf):
    return LLM(model=str(smollm_gguf), max_model_len=1024, seed=0)


def _run(llm, constraint: SO, n: int = 3, max_tokens: int = 80, prompts=PROMPTS):
    params = [SamplingParams(n=n, temperature=1.0, seed=10 + i, max_tokens=max_tokens,
                             structured_outputs=constraint) for i in range(len(prompts))]
    return [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


def test_json_schema_outputs_validate(llm):
    # compact JSON: with any whitespace allowed, a 135M model at temperature 1 can spend its
    # whole budget on newlines (as with vLLM's backends)
    outs = _run(llm, SO(json=PERSON, disable_any_whitespace=True), max_tokens=120)
    assert len(outs) == 12
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


def test_json_object_regex_choice_and_grammar(llm):
    for c in _run(llm, SO(json_object=True, whitespace_pattern="[ \\n]?"), max_tokens=120):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # cut by max_tokens: still a prefix of a JSON object
            assert c.finish_reason == "length" and c.text.lstrip().startswith("{")
    for c in _run(llm, SO(regex=DATE)):
        assert re.fullmatch(DATE, c.text) and c.finish_reason == "stop", c.text
    choices = ["red", "green", "blue sky"]
    assert {c.text for c in _run(llm, SO(choice=choices))} <= set(choices)
    for c in _run(llm, SO(grammar=GRAMMAR)):
        if c.finish_reason == "length":  # [a-z]+ may run to max_tokens: still the grammar's prefix
            assert re.fullmatch(r"(yes|no), because [a-z]*", c.text), c.text
        else:
            assert re.fullmatch(r"(yes|no), because [a-z]+\.", c.text), c.text


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:], [free, free] + [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(regex=DATE))] * 2,
        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch(DATE, o.outputs[0].text) for o in mixed[2:])


def test_max_tokens_and_stop_strings_still_apply(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs=SO(json=PERSON)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=40, stop=[", because"],
                                             structured_outputs=SO(grammar=GRAMMAR)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_grammar_state_survives_preemption(smollm_gguf):
    # 6 blocks of 16 tokens for 4 sequences of 40+ tokens: some are preempted and recomputed,
    # keeping the tokens they produced, and their grammar state with them
    numbers = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "minItems": 16, "maxItems": 16}
    small = LLM(model=str(smollm_gguf), max_model_len=96, num_gpu_blocks_override=6, seed=0,
                max_num_batched_tokens=16)
    outs = _run(small, SO(json=numbers, disable_any_whitespace=True), n=1, max_tokens=80)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), numbers)


def test_invalid_constraint_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex is not a valid regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="[")), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_constraints_that_allow_no_token_fail_that_request_alone(llm):
    """allowed_token_ids disjoint from the grammar's first tokens is refused before anything
    runs (ValueError naming allowed_token_ids; a 400 on the server); disjoint only later, the
    request finishes with "error" saying so (it used to emit an arbitrary token), and the
    requests beside it are untouched. (A grammar that can only end stops the request even under
    min_tokens: its output is whole.)"""
    tok = llm.get_tokenizer()
    x_id = tok.encode("x")[0]
    disjoint = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[x_id],
                              structured_outputs=SO(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["Answer:"], disjoint, use_tqdm=False)
    yes_ids = tok.encode("yes")  # allowed first, then nothing the grammar wants next
    later = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=yes_ids,
                           structured_outputs=SO(choice=["yes or no"]))
    whole = SamplingParams(temperature=0, max_tokens=8, min_tokens=6,
                           structured_outputs=SO(choice=["yes"]))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["Answer:", "Answer:", "Once upon a time"], [later, whole, free],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].token_ids == yes_ids[:1]
    assert outs[0].error.startswith("no token is allowed")
    assert (outs[1].outputs[0].text, outs[1].outputs[0].finish_reason) == ("yes", "stop")
    assert outs[2].outputs[0].token_ids == alone and outs[2].error is None


def test_a_grammar_the_engine_gives_up_on_is_an_error_not_a_stop(llm):
    """One rule of 2,500 alternatives passes the caps but exceeds llguidance's row limit (2,000
    items) once parsing starts: the request must end with "error" naming it, not with "stop"
    and a text that no alternative matches (what it did before)."""
    grammar = "start: " + " | ".join(f'"option number {i}"' for i in range(2500))
    params = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=SO(grammar=grammar))
    free = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["Answer:", "Once upon a time"], [params, free], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error", outs[0].outputs[0]
    assert "the grammar engine stopped" in outs[0].error and "max is 2000" in outs[0].error
    assert "<grammar>" not in outs[0].error  # the short message, not the whole grammar
    assert len(outs[1].outputs[0].token_ids) == 4 and outs[1].error is None
