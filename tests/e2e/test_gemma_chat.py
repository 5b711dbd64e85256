"""Chat on the real Gemma 3 270M GGUF, which has no tokenizer.chat_template and no eot_token_id:
LLM.chat renders the known Gemma turns (logged, with the override) and <end_of_turn> ends an
answer as EOS does (finish_reason "stop"), where before it ran on to max_tokens.

This GGUF is the pretrained model (google/gemma-3-270m), which on its own never puts
<end_of_turn> among its top 5 tokens in these chats (transformers' generate gives the same
tokens); the stop tests make it choose the token with logit_bias, as the issue's run did:
8 x <end_of_turn> with finish_reason "length".
"""
from __future__ import annotations

import logging

import pytest

from helpers import model_runner
from pagedllm import LLM, SamplingParams
from pagedllm.tokenizer.tokenizer import load_tokenizer

# ids in the file's vocabulary (tokenizer.ggml.tokens)
BOS, START_OF_TURN, END_OF_TURN, EOS = 2, 105, 106, 1
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": " Paris. "},
    {"role": "user", "content": [{"type": "text", "text": "And of Spain?"}]},
]
# Gemma's format: no system role (it opens the first user turn), the assistant is the model,
# each turn's text trimmed
RENDERED = ("<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\nParis.<end_of_turn>\n"
            "<start_of_turn>user\nAnd of Spain?<end_of_turn>\n"
            "<start_of_turn>model\n")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gemma(gemma_gguf, caplog_module) -> LLM:
    return LLM(model=str(gemma_gguf), max_model_len=512, max_num_seqs=2)


@pytest.fixture(scope="module")
def caplog_module():
    """The pagedllm log of the module's engine start, as text."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("pagedllm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_start_logs_the_known_template_and_its_override(gemma, caplog_module):
    line = next(r for r in caplog_module if "has no chat template" in r)
    assert "built-in Gemma template" in line
    assert "<start_of_turn> <end_of_turn>" in line  # what it was chosen by
    assert "--chat-template" in line and "LLM.chat(chat_template=...)" in line


def test_chat_renders_gemma_turns(gemma):
    out = gemma.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ids = out[0].prompt_token_ids
    tok = gemma.llm_engine.tokenizer
    assert ids == tok.encode(RENDERED, add_special_tokens=False)
    # one bos, and the turn markers as the single control tokens the model was trained on
    assert ids[:4] == [BOS, START_OF_TURN, tok.convert_tokens_to_ids("user"),
                       tok.convert_tokens_to_ids("\n")]
    assert ids.count(BOS) == 1 and ids.count(START_OF_TURN) == 4 and ids.count(END_OF_TURN) == 3
    assert tok.decode(ids) == RENDERED


def test_chat_template_argument_overrides_the_known_one(gemma):
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}model:"
    out = gemma.chat(QUESTION, SamplingParams(max_tokens=1), chat_template=own, use_tqdm=False)
    tok = gemma.llm_engine.tokenizer
    assert out[0].prompt_token_ids == tok.encode(
        "user: What is the capital of France?\nmodel:", add_special_tokens=False)


def test_end_of_turn_is_an_eos(gemma):
    assert gemma.llm_engine.eos_token_ids == {EOS, END_OF_TURN}


def test_greedy_answer_stops_on_end_of_turn(gemma):
    # min_tokens holds <end_of_turn> back as it holds EOS back: three tokens of answer first
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                            logit_bias={END_OF_TURN: 100})
    done = gemma.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert done.finish_reason == "stop"
    assert done.token_ids[-1] == END_OF_TURN and len(done.token_ids) == 4
    assert END_OF_TURN not in done.token_ids[:3] and done.text and "<end_of_turn>" not in done.text
    first = gemma.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8,
                                                logit_bias={END_OF_TURN: 100}), use_tqdm=False)
    assert first[0].outputs[0].finish_reason == "stop"
    assert first[0].outputs[0].token_ids == [END_OF_TURN] and first[0].outputs[0].text == ""


def test_fresh_tokenizer_of_the_file_gets_the_template_too(gemma_gguf):
    # the GGUF itself (the tokenizer cache's path), not the model store's exported folder
    tok = load_tokenizer(gemma_gguf)
    assert tok.apply_chat_template(CONVERSATION, tokenize=False,
                                   add_generation_prompt=True) == RENDERED


def test_the_captured_decode_step_gives_the_layer_loops_tokens(gemma):
    """The real Q4_K_M file decodes through the C++ stack (both RoPE tables, four (1 + w) norms
    a layer, GeGLU, q/k norms, 256-wide heads): the same greedy tokens and logprobs as the
    model's layer loop, counted so that the stack must have run."""
    runner = model_runner(gemma)
    captured, calls = runner.captured_decode, []
    assert captured is not None, runner.decode_path

    def counting(*args):
        calls.append(1)
        return captured(*args)

    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]

    def greedy() -> list[tuple[list[int], float]]:
        outs = gemma.generate(prompts, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs]

    runner.captured_decode = counting
    try:
        through_stack = greedy()
        runner.captured_decode = None
        assert greedy() == through_stack
    finally:
        runner.captured_decode = captured
    assert len(calls) >= 23
