"""The offline LLM gets the same protection: the limits are LLM(...) keyword arguments, a
constraint that excludes allowed_token_ids is a ValueError, and a request over its mask budget
finishes alone with "error" while the others in its batch go on."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams as SO


@pytest.fixture(scope="module")
def llm(smollm_gguf):
    # a budget no mask fits in: every constrained request stops at its second step
    return LLM(str(smollm_gguf), dtype="float32", max_model_len=256, max_grammar_mask_ms=1e-6,
               max_guided_choices=3)


def test_limits_are_llm_keyword_arguments(llm):
    config = llm.llm_engine.config.structured_outputs
    assert (config.max_grammar_mask_ms, config.max_guided_choices) == (1e-6, 3)
    params = SamplingParams(max_tokens=4, structured_outputs=SO(choice=["a", "b", "c", "d"]))
    with pytest.raises(ValueError, match=r"has 4 choices; at most 3 are allowed "
                                         r"\(max_guided_choices, --max-guided-choices\)"):
        llm.generate("Pick:", params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_grammar_rules must be a positive int"):
        LLM("unused", max_grammar_rules=0)


def test_allowed_ids_disjoint_from_the_grammar_are_a_value_error(llm):
    tokenizer = llm.llm_engine.tokenizer
    params = SamplingParams(max_tokens=4, allowed_token_ids=tokenizer.encode(" zebra"),
                            structured_outputs=SO(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="^allowed_token_ids excludes every token that "
                                         "structured_outputs.choice allows first"):
        llm.generate("Answer:", params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_request_over_its_mask_budget_fails_alone(llm):
    constrained = SamplingParams(max_tokens=8, temperature=0, n=2,
                                 structured_outputs=SO(regex="[a-z]{8}"))
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    bad, good = llm.generate(["Letters:", "Once upon a time"], [constrained, plain],
                             use_tqdm=False)
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert "more than max_grammar_mask_ms=1e-06 (--max-grammar-mask-ms)" in bad.error
    assert all(len(c.token_ids) == 1 for c in bad.outputs)  # the first step's mask was free
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 8
