"""A thinking model through a live server and the official openai SDK: the tiny Qwen3 of
thinking_model.py (its output is the known chain, checked against transformers), whose
reasoning the qwen3 parser (picked from Qwen3's template) keeps apart from its answer, its
JSON-schema answer and its tool calls, in chat completions, the Responses API and Anthropic's
Messages API (thinking blocks, through the anthropic SDK), streamed and not."""
from __future__ import annotations

import json

import anthropic
import pytest
from openai import OpenAI

from conftest import Server
from thinking_model import ANSWER, REASONING, hf_greedy

MODEL = "thinker"
ASK = [{"role": "user", "content": "hi"}]
YES_NO = {"type": "string", "enum": ["yes", "no"]}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
    "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(thinking_dir):
    srv = Server("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
                 model=str(thinking_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def _chat(client, max_tokens=20, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                          max_tokens=max_tokens, **kw)


def _stream(client, **kw):
    """(reasoning, reasoning_content, content, tool calls, finish reasons, usage) of a stream."""
    reasoning = alias = content = ""
    calls, finishes, usage = [], [], None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            alias += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += [tc.function for tc in c.delta.tool_calls or []]
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return reasoning, alias, content, calls, finishes, usage


def test_server_log_names_the_parser_and_output_matches_transformers(server, client,
                                                                     thinking_dir):
    assert "reasoning: using the 'qwen3' parser" in server.log_tail(20000)
    out = _chat(client, extra_body={"return_token_ids": True})
    prompt, tokens = out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"]
    assert tokens == hf_greedy(thinking_dir, prompt, 20)


def test_reasoning_apart_from_the_answer(client):
    out = _chat(client)
    msg = out.choices[0].message
    assert msg.content == ANSWER
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"] == REASONING
    # <think> Hmm , okay </think> are reasoning; "\n\n" Hello <|im_end|> the answer's
    assert out.usage.completion_tokens == 8
    assert out.usage.completion_tokens_details.reasoning_tokens == 5
    reasoning, alias, content, _, finishes, usage = _stream(client)
    assert (reasoning, alias, content, finishes) == (REASONING, REASONING, ANSWER, ["stop"])
    assert usage.completion_tokens_details.reasoning_tokens == 5


def test_include_reasoning_false_and_enable_thinking_false(client):
    msg = _chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert msg.content == ANSWER and "reasoning" not in (msg.model_extra or {})
    out = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == ANSWER
    assert out.choices[0].message.model_extra.get("reasoning") is None
    assert out.usage.completion_tokens_details.reasoning_tokens == 0


def test_cut_off_inside_the_thinking(client):
    out = _chat(client, max_tokens=2)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == ""
    assert choice.message.model_extra["reasoning"] == "Hmm"
    assert out.usage.completion_tokens_details.reasoning_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_after_the_thinking(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "yn", "schema": YES_NO}}
    if stream:
        reasoning, _, content, _, finishes, _ = _stream(client, response_format=fmt)
    else:
        msg = _chat(client, response_format=fmt).choices[0].message
        reasoning, content = msg.model_extra["reasoning"], msg.content
    assert reasoning == REASONING and json.loads(content) == "yes"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_after_the_thinking(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        reasoning, _, content, calls, finishes, _ = _stream(client, tools=[CITY],
                                                            tool_choice=named)
        assert finishes == ["tool_calls"] and content == ""
    else:
        choice = _chat(client, tools=[CITY], tool_choice=named).choices[0]
        reasoning, calls = choice.message.model_extra["reasoning"], [
            tc.function for tc in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert reasoning == REASONING
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                   {"city": "Paris"})]


def _responses(client, **kw):
    return client.responses.create(model=MODEL, input="hi", temperature=0,
                                   max_output_tokens=20, **kw)


def test_responses_reasoning_item_then_message(client):
    out = _responses(client)
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == REASONING and out.output_text == ANSWER
    assert out.usage.output_tokens_details.reasoning_tokens == 5
    events = list(_responses(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", *["response.reasoning_text.delta"] * 3,
                     "response.reasoning_text.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == ANSWER and done.output[0].content[0].text == REASONING


def test_responses_cut_off_inside_the_thinking(client):
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in out.output] == ["reasoning"] and out.output_text == ""


@pytest.mark.parametrize("stream", [False, True])
def test_responses_json_schema_and_tool_call_after_the_thinking(client, stream):
    fmt = {"format": {"type": "json_schema", "name": "yn", "schema": YES_NO}}
    tool = {"type": "function", "name": "get_weather",
            "parameters": CITY["function"]["parameters"]}
    for kw in ({"text": fmt}, {"tools": [tool],
                               "tool_choice": {"type": "function", "name": "get_weather"}}):
        if stream:
            out = [e for e in _responses(client, stream=True, **kw)][-1].response
        else:
            out = _responses(client, **kw)
        assert out.status == "completed" and out.output[0].type == "reasoning"
        assert out.output[0].content[0].text == REASONING
        if "text" in kw:
            assert json.loads(out.output_text) == "yes"
        else:
            (call,) = [item for item in out.output if item.type == "function_call"]
            assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def _message(server, stream: bool, **kw):
    """(the Message, the raw event types when stream) of a Messages API request."""
    client = anthropic.Anthropic(base_url=server.url, api_key="EMPTY", max_retries=0,
                                 timeout=60)
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 20, "extra_body": {"temperature": 0},
          **kw}
    if not stream:
        return client.messages.create(**kw), None
    with client.messages.stream(**kw) as events:
        message = events.get_final_message()
    raw = [(e.type, e.delta.type if e.type == "content_block_delta" else None)
           for e in client.messages.create(stream=True, **kw)]
    return message, raw


def _blocks(message) -> list[tuple]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text"
             else (b.name, b.input)) for b in message.content]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_block_then_text(server, stream):
    message, raw = _message(server, stream)
    assert _blocks(message) == [("thinking", REASONING), ("text", ANSWER)]
    assert message.content[0].signature == "" and message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 8
    if stream:
        # (the SDK leaves out the ping after message_start)
        assert raw == [("message_start", None), ("content_block_start", None),
                       *[("content_block_delta", "thinking_delta")] * 3,
                       ("content_block_delta", "signature_delta"), ("content_block_stop", None),
                       ("content_block_start", None), ("content_block_delta", "text_delta"),
                       ("content_block_stop", None), ("message_delta", None),
                       ("message_stop", None)]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_disabled_cut_off_and_tool_use(server, stream):
    off, _ = _message(server, stream, thinking={"type": "disabled"})
    assert _blocks(off) == [("text", ANSWER)] and off.stop_reason == "end_turn"
    cut, _ = _message(server, stream, max_tokens=2)
    assert _blocks(cut) == [("thinking", "Hmm")] and cut.stop_reason == "max_tokens"
    tool = {"name": "get_weather", "input_schema": CITY["function"]["parameters"]}
    call, _ = _message(server, stream, tools=[tool],
                       tool_choice={"type": "tool", "name": "get_weather"})
    assert _blocks(call) == [("thinking", REASONING), ("tool_use", ("get_weather",
                                                                   {"city": "Paris"}))]
    assert call.stop_reason == "tool_use"
    # the thinking block sent back is dropped from the prompt, as Anthropic drops it
    again, _ = _message(server, stream, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.content[1].id,
                                      "content": "sunny"}]}])
    assert again.content and again.content[0].type == "thinking"


def test_reasoning_parser_none_leaves_the_tags_in_the_answer(thinking_dir):
    srv = Server("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
                 "--reasoning-parser", "none", model=str(thinking_dir))
    try:
        plain = OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        out = _chat(plain)
        assert out.choices[0].message.content == f"<think>{REASONING}</think>\n\n{ANSWER}"
        assert "reasoning" not in (out.choices[0].message.model_extra or {})
        assert out.usage.completion_tokens_details is None
        assert "reasoning: using" not in srv.log_tail(20000)
    finally:
        srv.stop()
