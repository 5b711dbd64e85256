"""Reasoning parsers on fixed texts (deterministic): whole and streamed in every split, the
prompt's phase read through a real tokenizer with Qwen3's template, token counts; the grammar
gate on the tiny thinking Qwen3 offline (LLM(reasoning_parser=...)): a constraint starts after
</think>, and from the first token without a parser; speculated, drafts in both phases."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.reasoning_parsers import (ReasoningDelta, ReasoningParser,
                                                           ReasoningStreamer)
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.reasoning import (Phase, PhaseTracker, ReasoningTokens,
                                                  check_parser_name, parser_for_template)
from thinking_model import ANSWER, REASONING, TEMPLATE

QWEN3 = ReasoningTokens("qwen3", "<think>", "</think>", 1, 2, True)
R1 = ReasoningTokens("deepseek_r1", "<think>", "</think>", 1, 2, False)
FULL = "<think>\nLet me see: 2 + 2.\n</think>\n\n4."

# (tags, the phase the prompt leaves, output text) -> (reasoning or None, content)
CASES = [
    (QWEN3, Phase.OPENING, FULL, ("\nLet me see: 2 + 2.\n", "4.")),
    (QWEN3, Phase.OPENING, "  " + FULL, ("\nLet me see: 2 + 2.\n", "4.")),
    (QWEN3, Phase.OPENING, "4.", (None, "4.")),  # no thinking: all answer
    (QWEN3, Phase.OPENING, "<think>cut off", ("cut off", "")),  # max_tokens inside
    (QWEN3, Phase.OPENING, "<thi", (None, "<thi")),
    (QWEN3, Phase.OPENING, "", (None, "")),
    (QWEN3, Phase.THINKING, "Let me see.</think>\n\n4.", ("Let me see.", "4.")),
    (QWEN3, Phase.ANSWER, FULL, (None, FULL)),  # enable_thinking=false: tags are text
    (QWEN3, Phase.OPENING, "<think>a</think>\n\n<tool_call>{}</tool_call>",
     ("a", "<tool_call>{}</tool_call>")),
    (R1, Phase.THINKING, "Let me see.</think>\n\n4.", ("Let me see.", "4.")),
    (R1, Phase.THINKING, FULL, ("\nLet me see: 2 + 2.\n", "4.")),  # R1-0528 writes <think>
    (R1, Phase.THINKING, "no end tag", ("no end tag", "")),
    (R1, Phase.THINKING, "a</thi", ("a</thi", "")),  # a held partial tag at the end
]


@pytest.mark.parametrize("tokens,phase,text,expected", CASES)
def test_split_whole_text(tokens, phase, text, expected):
    parser = ReasoningParser.__new__(ReasoningParser)
    parser.tokens, parser.phase = tokens, phase
    assert parser.split(text) == expected


@pytest.mark.parametrize("tokens,phase,text,expected", CASES)
def test_every_streamed_split_gives_the_whole_texts_answer(tokens, phase, text, expected):
    """Pieces of one character, and every cut into two pieces (tags cut anywhere)."""
    cuts = [[text[i:i + 1] for i in range(len(text))]]
    cuts += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in cuts:
        stream = ReasoningStreamer(tokens, phase)
        out = ReasoningDelta()
        for piece in pieces:
            out = out + stream.feed(piece)
        out = out + stream.finish()
        assert ((out.reasoning if stream.thought else None), out.content) == expected, pieces


def test_tracker_counts_the_thinking_tokens_with_their_tags():
    assert PhaseTracker(QWEN3, Phase.OPENING).count([1, 7, 8, 2, 9, 9]) == 4
    assert PhaseTracker(QWEN3, Phase.OPENING).count([7, 1, 8, 2]) == 0  # no opening tag first
    assert PhaseTracker(R1, Phase.THINKING).count([7, 8, 2, 9]) == 3
    assert PhaseTracker(QWEN3, Phase.ANSWER).count([1, 7, 2]) == 0
    assert PhaseTracker(QWEN3, Phase.OPENING).count([1, 7, 8]) == 3  # cut off inside


def test_parser_names_and_the_templates_that_imply_them():
    template = TEMPLATE.read_text()
    assert parser_for_template(template) == "qwen3"
    assert parser_for_template("{{ '<|Assistant|><think>\\n' }}...</think>") == "deepseek_r1"
    assert parser_for_template("{{ messages }}") is None
    check_parser_name("none")
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        check_parser_name("qwen4")


@pytest.fixture(scope="module")
def thinking_llm(thinking_dir):
    return LLM(model=str(thinking_dir), dtype="float32", max_model_len=512)


def test_phase_read_from_qwen3_prompts(thinking_llm):
    engine = thinking_llm.llm_engine
    tokens, tok = engine.input_processor.reasoning, engine.tokenizer
    assert tokens.name == "qwen3"  # picked from the chat template
    ask = [{"role": "user", "content": "hi"}]
    on = engine.input_processor.chat_prompt_ids(ask)
    off = engine.input_processor.chat_prompt_ids(
        ask, chat_template_kwargs={"enable_thinking": False})
    assert tokens.first_phase(on, tok) is Phase.OPENING
    assert tokens.first_phase(off, tok) is Phase.ANSWER
    opened = on + tok.encode("<think>\n", add_special_tokens=False)
    assert tokens.first_phase(opened, tok) is Phase.THINKING
    with pytest.raises(ValueError, match="needs <think> as one token"):
        ReasoningTokens.from_tokenizer("qwen3", _NoThinkTokenizer())


class _NoThinkTokenizer:
    def encode(self, text, add_special_tokens=False):
        return list(range(len(text)))


YES_NO = StructuredOutputsParams(json={"type": "string", "enum": ["yes", "no"]})
ASK = [{"role": "user", "content": "hi"}]


def test_model_thinks_then_answers(thinking_llm):
    (out,) = thinking_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert out.outputs[0].text == f"<think>{REASONING}</think>\n\n{ANSWER}"


def test_grammar_starts_after_the_thinking(thinking_llm):
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=YES_NO)
    (out,) = thinking_llm.chat(ASK, params, use_tqdm=False)
    assert out.outputs[0].text == f'<think>{REASONING}</think>"yes"'
    assert out.outputs[0].finish_reason == "stop"
    # enable_thinking=false: the prompt closed the thinking, the grammar holds from the start
    (out,) = thinking_llm.chat(ASK, params, use_tqdm=False,
                               chat_template_kwargs={"enable_thinking": False})
    assert out.outputs[0].text == '"yes"'


def test_speculation_drafts_the_thinking_then_the_answer_under_its_grammar(thinking_dir):
    """With a prediction of the whole output, drafts are kept while the model thinks (up to
    </think>, every id allowed) and in the answer (checked against its grammar); the output is
    plain decoding's. Its logprobs agree to float32 rounding only: this model's float32 head
    is torch's matmul, whose sums round differently for one row and for a verify's k + 1 (the
    GGUF models' kernels are exact: tests/e2e/test_spec_decode_exactness.py)."""
    llm = LLM(model=str(thinking_dir), dtype="float32", max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                  "min_acceptance_rate": 0.0})  # a fixed k of 4
    scheduler = llm.llm_engine.engine_core.scheduler
    speculator, counts = scheduler.speculator, []
    record = speculator.record
    speculator.record = lambda r, n, a: counts.append((r.grammar.tracker.phase, n, a)) or \
        record(r, n, a)
    text = f'<think>{REASONING}</think>"yes"'
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2,
                            structured_outputs=YES_NO, prediction=text)
    (spec,) = llm.chat(ASK, params, use_tqdm=False)
    scheduler.speculator = None
    (plain,) = llm.chat(ASK, params, use_tqdm=False)
    assert spec.outputs[0].text == text and spec.outputs[0].finish_reason == "stop"
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    for got, expected in zip(spec.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert list(got) == list(expected)
        assert [v.logprob for v in got.values()] == \
            pytest.approx([v.logprob for v in expected.values()], rel=1e-6)
    assert counts[0] == (Phase.THINKING, 2, 2)  # "," " okay", cut before </think>
    assert any(phase is Phase.ANSWER and kept > 0 for phase, _, kept in counts)


def test_without_a_parser_the_grammar_holds_from_the_first_token(thinking_dir):
    llm = LLM(model=str(thinking_dir), dtype="float32", max_model_len=512,
              reasoning_parser="none")
    assert llm.llm_engine.input_processor.reasoning is None
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=YES_NO)
    (out,) = llm.chat(ASK, params, use_tqdm=False)
    assert out.outputs[0].text == '"yes"'


def test_unknown_parser_is_refused_before_loading():
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1 or "
                       "'none', got 'qwen4'"):
        LLM(model="/nonexistent", reasoning_parser="qwen4")
