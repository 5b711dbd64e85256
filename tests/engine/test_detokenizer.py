"""IncrementalDetokenizer on the shipped tokenizers: whole characters, special tokens, stops."""
from __future__ import annotations

from typing import Optional

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams


def _feed(tokenizer, params: SamplingParams,
          ids: list[int]) -> tuple[list[str], list[Optional[str]]]:
    """Feed ids one per update(); the text after each call and what each call returned."""
    detok = IncrementalDetokenizer(tokenizer, params)
    texts, stops = [], []
    for token_id in ids:
        stops.append(detok.update([token_id]))
        texts.append(detok.text)
    return texts, stops


def test_byte_tokens_of_one_character_wait_for_the_whole_character(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("Hello 😀 世界 — ok")
    # SmolLM has no token for the emoji or the CJK characters: they come as single bytes
    assert ids == [19556, 40303, 218, 216, 7906, 240, 178, 239, 230, 1841, 10907]
    texts, stops = _feed(tok, SamplingParams(), ids)
    assert texts == ["Hello", "Hello", "Hello 😀", "Hello 😀 ", "Hello 😀 ", "Hello 😀 世",
                     "Hello 😀 世", "Hello 😀 世", "Hello 😀 世界", "Hello 😀 世界 —",
                     "Hello 😀 世界 — ok"]
    assert stops == [None] * len(ids)
    assert texts[-1] == tok.decode(ids)


@pytest.mark.parametrize("name", ["qwen", "smollm"])
def test_streamed_text_only_grows_and_ends_as_decode(name, qwen_tokenizer, smollm_tokenizer):
    tok = {"qwen": qwen_tokenizer, "smollm": smollm_tokenizer}[name]
    ids = tok.encode("𝔘𝔫𝔦 ꙮ 🦜🦜 — 東京")
    # both tokenizers split some of these characters into byte tokens that decode to U+FFFD alone
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    texts, _ = _feed(tok, SamplingParams(), ids)
    assert all("\ufffd" not in t for t in texts)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == tok.decode(ids) == "𝔘𝔫𝔦 ꙮ 🦜🦜 — 東京"


@pytest.mark.parametrize("name", ["qwen", "smollm"])
@pytest.mark.parametrize("skip, expected", [(True, "abc"), (False, "a<|im_end|>b<|im_start|>c")])
def test_skip_special_tokens(name, skip, expected, qwen_tokenizer, smollm_tokenizer):
    tok = {"qwen": qwen_tokenizer, "smollm": smollm_tokenizer}[name]
    ids = tok.encode("a<|im_end|>b<|im_start|>c")
    assert len(ids) == 5  # the markers are single special tokens
    texts, _ = _feed(tok, SamplingParams(skip_special_tokens=skip), ids)
    assert texts[-1] == expected == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("include, expected", [(False, "The answer is: "),
                                               (True, "The answer is: STOP")])
def test_stop_string_split_across_two_tokens(smollm_tokenizer, include, expected):
    tok = smollm_tokenizer
    ids = tok.encode("The answer is: STOP here")
    assert [tok.decode([i]) for i in ids][4:6] == [" ST", "OP"]
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=include)
    texts, stops = _feed(tok, params, ids[:6])
    assert stops == [None, None, None, None, None, "STOP"]
    assert texts[-1] == expected


@pytest.mark.parametrize("include, expected", [(False, "The answer is: "),
                                               (True, "The answer is: STOP")])
def test_tokens_after_the_stop_in_the_same_update_are_dropped(smollm_tokenizer, include, expected):
    tok = smollm_tokenizer
    params = SamplingParams(stop="STOP", include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, params)
    assert detok.update(tok.encode("The answer is: STOP here")) == "STOP"
    assert detok.text == expected


def test_earliest_stop_in_the_text_wins_not_the_first_listed(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = tok.encode("The answer is")
    assert [tok.decode([i]) for i in ids] == ["The", " answer", " is"]
    texts, stops = _feed(tok, SamplingParams(stop=["swer", "ans"]), ids[:2])
    assert stops == [None, "ans"]  # both end inside " answer"; "ans" starts first
    assert texts == ["The", "The "]


def test_stop_string_spanning_three_tokens(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = tok.encode("The answer is: 42")
    assert [tok.decode([i]) for i in ids][:4] == ["The", " answer", " is", ":"]
    # the short stop "x" must not shrink the window searched for the long one
    texts, stops = _feed(tok, SamplingParams(stop=["x", "answer is:"]), ids[:4])
    assert stops == [None, None, None, "answer is:"]
    assert texts[-1] == "The "
