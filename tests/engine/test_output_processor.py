"""OutputProcessor fed EngineCoreOutputs by hand: text, finish reasons, logprobs, n samples."""
from __future__ import annotations

import pytest

from pagedllm.core.outputs import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams

HELLO, WORLD, BANG, HI = 9707, 1879, 0, 13048  # Qwen2.5: "Hello", " world", "!", "Hi"
IM_END = 151645  # Qwen2.5's <|im_end|>, an EOS
PROMPT_IDS = [21018]  # " Hi"


def _processor(tokenizer, params: SamplingParams, n: int = 1) -> OutputProcessor:
    """A processor holding request "r"; one child "r" when n == 1, else "0_r", "1_r", ..."""
    op = OutputProcessor(tokenizer)
    children = [("r", params)] if n == 1 else [(f"{i}_r", params) for i in range(n)]
    op.add_request("r", " Hi", PROMPT_IDS, children)
    return op


def test_text_and_token_ids_are_cumulative_until_length(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams())
    seen = []
    for token_id in (HELLO, WORLD):
        outs, to_abort = op.process([EngineCoreOutput("r", [token_id])])
        assert to_abort == []
        [out] = outs
        assert (out.request_id, out.prompt, out.prompt_token_ids) == ("r", " Hi", PROMPT_IDS)
        assert not out.finished and out.outputs[0].finish_reason is None
        seen.append((out.outputs[0].text, out.outputs[0].token_ids))
    assert seen == [("Hello", [HELLO]), ("Hello world", [HELLO, WORLD])]
    [out], _ = op.process([EngineCoreOutput("r", [BANG], finish_reason="length")])
    comp = out.outputs[0]
    assert out.finished and not op.has_unfinished()
    assert (comp.text, comp.token_ids, comp.finish_reason, comp.stop_reason) == (
        "Hello world!", [HELLO, WORLD, BANG], "length", None)
    assert (comp.logprobs, comp.cumulative_logprob) == (None, None)
    # a finished request is forgotten: late outputs for it are ignored
    assert op.process([EngineCoreOutput("r", [HELLO])]) == ([], [])


def test_eos_and_stop_token_finish_with_the_core_reason(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams())
    [out], _ = op.process([EngineCoreOutput("r", [HELLO, IM_END], finish_reason="stop")])
    comp = out.outputs[0]
    # the EOS token is in token_ids but, being special, not in the text
    assert (comp.text, comp.token_ids, comp.finish_reason, comp.stop_reason) == (
        "Hello", [HELLO, IM_END], "stop", None)
    op = _processor(qwen_tokenizer, SamplingParams(stop_token_ids=[BANG]))
    core_out = EngineCoreOutput("r", [BANG], finish_reason="stop", stop_reason=BANG)
    [out], to_abort = op.process([core_out])
    comp = out.outputs[0]
    assert (comp.finish_reason, comp.stop_reason, to_abort) == ("stop", BANG, [])


def test_detokenize_off_gives_tokens_without_text(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams(detokenize=False, stop=["Hello"]))
    [out], to_abort = op.process([EngineCoreOutput("r", [HELLO])])
    assert (out.outputs[0].text, out.outputs[0].token_ids, to_abort) == ("", [HELLO], [])


@pytest.mark.parametrize("include, text", [(False, "The answer is: "),
                                           (True, "The answer is: STOP")])
def test_stop_string_finishes_and_asks_the_core_to_abort(smollm_tokenizer, include, text):
    tok = smollm_tokenizer
    ids = tok.encode("The answer is: STOP here")  # " ST" and "OP" are separate tokens
    op = _processor(tok, SamplingParams(stop="STOP", include_stop_str_in_output=include))
    for token_id in ids[:5]:
        [out], to_abort = op.process([EngineCoreOutput("r", [token_id])])
        assert to_abort == [] and not out.finished
    [out], to_abort = op.process([EngineCoreOutput("r", [ids[5]])])
    comp = out.outputs[0]
    assert to_abort == ["r"]
    assert out.finished and not op.has_unfinished()
    assert (comp.text, comp.token_ids, comp.finish_reason, comp.stop_reason) == (
        text, ids[:6], "stop", "STOP")
    # the core may emit once more before the abort lands
    assert op.process([EngineCoreOutput("r", [ids[6]])]) == ([], [])


def test_stop_string_on_the_core_s_last_token_is_not_aborted(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams(stop=" world"))
    [out], to_abort = op.process([EngineCoreOutput("r", [HELLO, WORLD], finish_reason="length")])
    # the core already finished the sequence; the stop string still names the reason
    assert to_abort == []
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (
        "Hello", "stop", " world")


def test_streamed_text_is_never_taken_back(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("The answer is: STOP here")
    op = _processor(tok, SamplingParams(stop="STOP"))
    outs = [op.process([EngineCoreOutput("r", [i])])[0][0] for i in ids[:6]]
    texts = [o.outputs[0].text for o in outs]
    assert all(texts[-1].startswith(t) for t in texts)
    assert outs[-1].finished and texts[-1] == "The answer is: "
    # while unfinished, the last len("STOP") - 1 characters wait: they could begin "STOP"
    assert "ST" not in "".join(texts[:-1])


def test_logprobs_become_dicts_with_ranks_and_decoded_tokens(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams(logprobs=2))
    steps = [
        # the sampled token first, then the top-2; "Hello" was the most likely, so it is also top-1
        (HELLO, TokenLogprobs([HELLO, HELLO, HI], [-0.25, -0.25, -1.5], rank=1)),
        # " world" was 7th; the top-2 are other tokens
        (WORLD, TokenLogprobs([WORLD, BANG, HI], [-3.0, -0.5, -1.0], rank=7)),
        # "!" ties with "Hi": the sampler ranks it 2 (tokens at least as likely) though the top-k
        # lists it first; the sampled token's own rank is kept
        (BANG, TokenLogprobs([BANG, BANG, HI], [-0.75, -0.75, -0.75], rank=2)),
    ]
    for token_id, lp in steps:
        [out], _ = op.process([EngineCoreOutput("r", [token_id], new_logprobs=[lp])])
    comp = out.outputs[0]
    assert comp.logprobs == [
        {HELLO: Logprob(-0.25, 1, "Hello"), HI: Logprob(-1.5, 2, "Hi")},
        {WORLD: Logprob(-3.0, 7, " world"), BANG: Logprob(-0.5, 1, "!"),
         HI: Logprob(-1.0, 2, "Hi")},
        {BANG: Logprob(-0.75, 2, "!"), HI: Logprob(-0.75, 2, "Hi")},
    ]
    assert [list(d) for d in comp.logprobs] == [[HELLO, HI], [WORLD, BANG, HI], [BANG, HI]]
    assert comp.cumulative_logprob == -4.0


def test_prompt_logprobs_start_with_none_for_the_first_prompt_token(qwen_tokenizer):
    op = OutputProcessor(qwen_tokenizer)
    op.add_request("r", "Hello world!", [HELLO, WORLD, BANG],
                   [("r", SamplingParams(prompt_logprobs=1))])
    prompt_lps = [TokenLogprobs([WORLD, HI], [-2.0, -0.5], rank=3),
                  TokenLogprobs([BANG, BANG], [-0.75, -0.75], rank=1)]
    [out], _ = op.process([EngineCoreOutput("r", [HI], new_prompt_logprobs=prompt_lps)])
    assert out.prompt_logprobs == [None,
                                   {WORLD: Logprob(-2.0, 3, " world"), HI: Logprob(-0.5, 1, "Hi")},
                                   {BANG: Logprob(-0.75, 1, "!")}]
    assert out.outputs[0].logprobs is None


def test_n_samples_gather_into_one_output_ordered_by_index(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams(n=2), n=2)
    assert op.child_ids("r") == ["0_r", "1_r"]
    # the core lists sample 1 before sample 0
    outs, _ = op.process([EngineCoreOutput("1_r", [WORLD]), EngineCoreOutput("0_r", [HELLO])])
    [out] = outs
    assert [(c.index, c.text) for c in out.outputs] == [(0, "Hello"), (1, " world")]
    [out], _ = op.process([EngineCoreOutput("1_r", [BANG], finish_reason="length")])
    assert not out.finished
    assert [(c.text, c.finish_reason) for c in out.outputs] == [("Hello", None),
                                                                (" world!", "length")]
    assert op.child_ids("r") == ["0_r"] and op.has_unfinished()
    [out], _ = op.process([EngineCoreOutput("0_r", [IM_END], finish_reason="stop")])
    assert out.finished and not op.has_unfinished()
    assert [(c.text, c.finish_reason) for c in out.outputs] == [("Hello", "stop"),
                                                                (" world!", "length")]


def test_stop_string_aborts_only_that_sample(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams(n=2, stop="!"), n=2)
    [out], to_abort = op.process([EngineCoreOutput("0_r", [HELLO]),
                                  EngineCoreOutput("1_r", [BANG])])
    assert to_abort == ["1_r"] and not out.finished
    assert [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [
        ("Hello", None, None), ("", "stop", "!")]
    assert op.child_ids("r") == ["0_r"]


def test_abort_marks_unfinished_samples_and_forgets_the_request(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams(n=2), n=2)
    op.process([EngineCoreOutput("0_r", [HELLO]),
                EngineCoreOutput("1_r", [WORLD], finish_reason="length")])
    out = op.abort("r")
    assert out.finished and out.request_id == "r"
    assert [(c.text, c.finish_reason) for c in out.outputs] == [("Hello", "abort"),
                                                                (" world", "length")]
    assert op.child_ids("r") == [] and not op.has_unfinished()
    assert op.abort("r") is None
    assert op.process([EngineCoreOutput("0_r", [BANG])]) == ([], [])


def test_unknown_request_ids_are_ignored(qwen_tokenizer):
    op = _processor(qwen_tokenizer, SamplingParams())
    assert op.process([EngineCoreOutput("other", [HELLO])]) == ([], [])
    assert op.abort("other") is None
    assert op.has_unfinished()


def test_delta_outputs_carry_only_what_is_new(qwen_tokenizer):
    """RequestOutputKind.DELTA: each sample's new text and the tokens (and logprobs) that made
    it; text that may still become a stop string (here the last character) waits; a finished
    sample appears once."""
    from pagedllm.sampling_params import RequestOutputKind

    lp = TokenLogprobs([HELLO], [-0.5], 1)
    op = _processor(qwen_tokenizer, SamplingParams(output_kind=RequestOutputKind.DELTA,
                                                   stop=["d!"], logprobs=0), n=2)
    [out], _ = op.process([EngineCoreOutput("0_r", [HELLO], [lp]),
                           EngineCoreOutput("1_r", [HI], [TokenLogprobs([HI], [-1.0], 1)])])
    assert [(c.index, c.text, c.token_ids) for c in out.outputs] == [(0, "Hell", [HELLO]),
                                                                     (1, "H", [HI])]
    assert [len(c.logprobs) for c in out.outputs] == [1, 1]
    [out], _ = op.process([EngineCoreOutput("0_r", [WORLD], [TokenLogprobs([WORLD], [-2.0], 1)])])
    assert [(c.index, c.text, c.token_ids) for c in out.outputs] == [(0, "o worl", [WORLD])]
    assert out.outputs[0].cumulative_logprob == pytest.approx(-2.5)
    [out], abort = op.process([EngineCoreOutput("1_r", [IM_END], [TokenLogprobs([IM_END], [0.0], 1)],
                                                finish_reason="stop")])
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [
        (1, "i", [IM_END], "stop")]  # finished: the held character goes out
    assert not out.finished
    [out], abort = op.process([EngineCoreOutput("0_r", [BANG], [TokenLogprobs([BANG], [0.0], 1)])])
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [
        (0, "", [BANG], "stop")]  # "d!" was the stop string: the held "d" is cut with it
    assert out.finished and abort == ["0_r"]


def test_final_only_outputs_once_at_the_end(qwen_tokenizer):
    from pagedllm.sampling_params import RequestOutputKind

    op = _processor(qwen_tokenizer, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    assert op.process([EngineCoreOutput("r", [HELLO])]) == ([], [])
    [out], _ = op.process([EngineCoreOutput("r", [WORLD], finish_reason="length")])
    assert out.finished and out.outputs[0].text == "Hello world"
    assert out.outputs[0].token_ids == [HELLO, WORLD]
