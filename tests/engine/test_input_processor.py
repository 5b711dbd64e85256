"""InputProcessor with Qwen2.5's real tokenizer: prompt forms, limits, n child requests."""
from __future__ import annotations

import pytest

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.sampling_params import SamplingParams

VOCAB = 151936  # Qwen2.5's embedding rows (arch.vocab_size), what LLMEngine passes
EOS = frozenset({151643, 151645})
MAX_LEN = 32


@pytest.fixture(scope="module")
def proc(qwen_tokenizer) -> InputProcessor:
    return InputProcessor(qwen_tokenizer, max_model_len=MAX_LEN, vocab_size=VOCAB,
                          eos_token_ids=EOS, block_size=16, max_logprobs=5)


def test_text_prompt_is_tokenized_into_one_request(proc, qwen_tokenizer):
    params = SamplingParams(max_tokens=8)
    out = proc.process("r1", "Hello world", params)
    assert out.prompt == "Hello world"
    assert out.prompt_token_ids == qwen_tokenizer.encode("Hello world") == [9707, 1879]
    [req] = out.requests
    assert req.request_id == "r1"
    assert req.prompt_token_ids == [9707, 1879]
    assert req.sampling_params is params
    assert (req.max_tokens, req.eos_token_ids, req.block_size) == (8, EOS, 16)


@pytest.mark.parametrize("prompt, text", [
    ({"prompt_token_ids": [9707, 1879]}, None),
    ([9707, 1879], None),
    ((9707, 1879), None),
    ({"prompt": "Hello world"}, "Hello world"),
    # ids win over text; the text is kept as given, for echo
    ({"prompt": "ignored for tokens", "prompt_token_ids": [9707, 1879]}, "ignored for tokens"),
])
def test_prompt_forms(proc, prompt, text):
    out = proc.process("r", prompt, SamplingParams())
    assert (out.prompt, out.prompt_token_ids) == (text, [9707, 1879])
    assert out.requests[0].prompt_token_ids == [9707, 1879]


def test_longest_prompt_leaves_room_for_one_token(proc):
    out = proc.process("r", [1] * (MAX_LEN - 1), SamplingParams(max_tokens=100))
    assert out.requests[0].max_tokens == 1
    with pytest.raises(ValueError, match=r"prompt is 32 tokens long but max_model_len is 32"):
        proc.process("r", [1] * MAX_LEN, SamplingParams())
    with pytest.raises(ValueError, match=r"prompt is 40 tokens long but max_model_len is 32"):
        proc.process("r", " a" * 40, SamplingParams())  # " a" is one token


@pytest.mark.parametrize("max_tokens, resolved", [(None, 30), (100, 30), (30, 30), (7, 7)])
def test_max_tokens_is_capped_by_the_room_left(proc, max_tokens, resolved):
    out = proc.process("r", [9707, 1879], SamplingParams(max_tokens=max_tokens))
    assert out.requests[0].max_tokens == resolved


@pytest.mark.parametrize("ids, bad", [([9707, VOCAB], str(VOCAB)), ([-1], "-1"), ([True], "True"),
                                      ([1.0], "1.0"), (["5"], "'5'")])
def test_token_ids_outside_the_vocabulary_are_rejected(proc, ids, bad):
    msg = rf"prompt_token_ids must be ints in \[0, {VOCAB}\), got {bad}$"
    with pytest.raises(ValueError, match=msg):
        proc.process("r", ids, SamplingParams())
    with pytest.raises(ValueError, match=msg):
        proc.process("r", {"prompt_token_ids": ids}, SamplingParams())


def test_largest_token_id_is_accepted(proc):
    assert proc.process("r", [VOCAB - 1], SamplingParams()).prompt_token_ids == [VOCAB - 1]


@pytest.mark.parametrize("prompt, msg", [
    ("", "prompt must not be empty"),
    ({"prompt": ""}, "prompt must not be empty"),
    ([], "prompt_token_ids must be a non-empty list of ints"),
    ({"prompt_token_ids": []}, "prompt_token_ids must be a non-empty list of ints"),
    ({"prompt_token_ids": "Hello"}, "prompt_token_ids must be a non-empty list of ints"),
    ({}, r"prompt dict must have a 'prompt' \(text\) or 'prompt_token_ids' key, got keys \[\]"),
    ({"text": "Hello"}, r"got keys \['text'\]"),
    (None, "prompt must be a string, a list of token ids, or a dict .* got NoneType"),
    (42, "got int"),
])
def test_empty_or_malformed_prompts_are_rejected(proc, prompt, msg):
    with pytest.raises(ValueError, match=msg):
        proc.process("r", prompt, SamplingParams())


def test_whitespace_prompt_is_a_real_prompt(proc):
    assert proc.process("r", " ", SamplingParams()).prompt_token_ids == [220]


def test_n_samples_become_child_requests_with_distinct_ids_and_seeds(proc):
    params = SamplingParams(n=3, seed=7, max_tokens=4)
    out = proc.process("req", "Hello world", params)
    assert [r.request_id for r in out.requests] == ["0_req", "1_req", "2_req"]
    assert [r.sampling_params.seed for r in out.requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 3 and r.max_tokens == 4 for r in out.requests)
    assert params.seed == 7  # the caller's params are not edited
    # each child owns its prompt list
    assert len({id(r.prompt_token_ids) for r in out.requests}) == 3
    assert out.prompt_token_ids == [9707, 1879]


def test_n_samples_without_seed_share_the_params(proc):
    params = SamplingParams(n=2)
    out = proc.process("req", "Hello world", params)
    assert [r.request_id for r in out.requests] == ["0_req", "1_req"]
    assert all(r.sampling_params is params for r in out.requests)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_are_limited_by_max_logprobs(proc, field):
    assert proc.process("r", [1], SamplingParams(**{field: 5})).requests
    msg = rf"{field} must be <= 5 \(the engine's max_logprobs\), got 6"
    with pytest.raises(ValueError, match=msg):
        proc.process("r", [1], SamplingParams(**{field: 6}))


def test_params_must_be_sampling_params(proc):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, got dict"):
        proc.process("r", [1], {"max_tokens": 4})


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias keys"),
    ({"allowed_token_ids": [0, VOCAB + 5]}, "allowed_token_ids"),
])
def test_ids_outside_the_vocabulary_in_sampling_params_are_rejected(proc, kwargs, field):
    with pytest.raises(ValueError, match=rf"{field} must be token ids in \[0, {VOCAB}\), got"):
        proc.process("r", [1], SamplingParams(**kwargs))
    ok = {k: ({VOCAB - 1: 1.0} if k == "logit_bias" else [VOCAB - 1]) for k in kwargs}
    assert proc.process("r", [1], SamplingParams(**ok)).requests
