"""logit_bias and allowed_token_ids on the real SmolLM2 weights, through LLM.generate."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def llm(smollm_gguf):
    return LLM(model=str(smollm_gguf), max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def word_ids(llm):
    """Three single-token words, none of them the model's likely continuation."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(w, add_special_tokens=False) for w in (" banana", " purple", " seven")]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_bound_every_generated_token(llm, word_ids, temperature):
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=8, ignore_eos=True,
                            allowed_token_ids=word_ids)
    for out in llm.generate(PROMPTS, params):
        assert len(out.outputs[0].token_ids) == 8
        assert set(out.outputs[0].token_ids) <= set(word_ids)


def test_plus_100_bias_makes_greedy_repeat_the_id(llm, word_ids):
    target = word_ids[1]
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={target: 100})
    for out in llm.generate(PROMPTS, params):
        assert out.outputs[0].token_ids == [target] * 6


def test_a_biased_row_leaves_its_neighbours_unchanged(llm, word_ids):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPTS, greedy)
    biased = SamplingParams(temperature=0, max_tokens=6, logit_bias={word_ids[0]: 100})
    mixed = llm.generate(PROMPTS, [greedy, biased])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == [word_ids[0]] * 6


def test_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, "):
        llm.generate("Hi", SamplingParams(logit_bias={10**7: 1.0}))
