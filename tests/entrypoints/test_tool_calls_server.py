"""Tool calling through the server with the official openai client, on the default model
(Qwen2.5-Coder-0.5B-Instruct, hermes format): a round trip through the chat template, required,
named and auto tool_choice, streamed and not, and a 400 naming the field for invalid input."""
from __future__ import annotations

import json

import pytest
from openai import BadRequestError, OpenAI

from conftest import QWEN, QWEN_KEY

MODEL = QWEN  # conftest's qwen_server
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# with tools in the prompt the 0.5B model answers a tool result with more calls; the final turn
# goes without tools (the template still renders the call and its result) and with this prompt
ANSWER = [{"role": "system", "content": "You are a helpful assistant. After a tool result "
           "arrives, answer the user in one plain sentence."}]


@pytest.fixture(scope="module")
def client(qwen_server):
    return OpenAI(base_url=f"{qwen_server.url}/v1", api_key=QWEN_KEY, max_retries=0, timeout=120)


def _create(client, **kw):
    return client.chat.completions.create(model=MODEL, temperature=0, **kw)


def _stream(client, index=0, **kw):
    """The streamed choice `index` as (content, tool_calls as dicts, finish reasons seen)."""
    content, calls, finishes = "", [], []
    for chunk in _create(client, stream=True, **kw):
        for c in chunk.choices:
            if c.index != index:
                continue
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                assert tc.index == len(calls) and tc.id.startswith("chatcmpl-tool-")
                calls.append({"name": tc.function.name, "arguments": tc.function.arguments})
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    return content, calls, finishes


def _one_call(message):
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    return call.function.name, json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_named_call_then_text_answer(client, stream):
    first = _create(client, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    name, args = _one_call(choice.message)
    assert name == "get_weather" and isinstance(args.get("city"), str), args
    call = choice.message.tool_calls[0]
    messages = ANSWER + ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"city": args["city"], "temperature_c": 18, "sky": "sunny"})}]
    if not stream:
        final = _create(client, messages=messages, max_tokens=48)
        answer = final.choices[0]
        assert not answer.message.tool_calls and answer.finish_reason in ("stop", "length")
        text = answer.message.content
    else:
        text, calls, finishes = _stream(client, messages=messages, max_tokens=48)
        assert calls == [] and len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert text and "<tool_call>" not in text
    assert "18" in text or "sunny" in text.lower(), text  # the tool's result reached the model


@pytest.mark.parametrize("index", [0, 1])
def test_named_streamed_at_n2_equals_plain(client, index):
    plain = _create(client, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=40)
    content, calls, finishes = _stream(client, index, messages=ASK, tools=TOOLS, n=2,
                                       tool_choice=NAMED, max_tokens=40)
    fn = plain.choices[0].message.tool_calls[0].function
    assert content == "" and finishes == ["tool_calls"]  # one finish chunk per choice
    assert calls == [{"name": fn.name, "arguments": fn.arguments}]


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_valid_calls(client, stream):
    kw = dict(messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
              tool_choice="required", max_tokens=60)
    if stream:
        content, calls, finishes = _stream(client, **kw)
        assert content == "" and finishes == ["tool_calls"]
    else:
        choice = _create(client, **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
    assert calls
    for call in calls:
        args = json.loads(call["arguments"])
        assert call["name"] in ("get_weather", "get_time")
        assert set(args) == {"city"} if call["name"] == "get_weather" else {"timezone"}


def test_streamed_tool_calls_carry_every_token_logprob(client):
    entries, completion_tokens = [], None
    for chunk in _create(client, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=40,
                         logprobs=True, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            entries += c.logprobs.content if c.logprobs else []
        if chunk.usage:
            completion_tokens = chunk.usage.completion_tokens
    assert completion_tokens and len(entries) == completion_tokens


def test_required_without_parallel_calls_makes_one(client):
    choice = _create(client, messages=[{"role": "user", "content": "Weather and time in Oslo?"}],
                     tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                     max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


def test_none_renders_tools_and_parses_nothing(client):
    choice = _create(client, messages=ASK, tools=TOOLS, tool_choice="none",
                     max_tokens=24).choices[0]
    assert not choice.message.tool_calls and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    content, calls, finishes = _stream(client, messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=24)
    assert (content, calls, finishes) == (choice.message.content, [], [choice.finish_reason])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_is_well_formed(client, stream):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=60)
    if stream:
        content, calls, finishes = _stream(client, **kw)
        finish = finishes[0]
        assert len(finishes) == 1
    else:
        choice = _create(client, **kw).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
    assert "<tool_call>" not in content
    if calls:  # what Qwen2.5-Coder-0.5B does here at temperature 0 (bare JSON, no tags)
        assert finish == "tool_calls" and not content
        for call in calls:
            assert call["name"] in ("get_weather", "get_time")
            assert isinstance(json.loads(call["arguments"]), dict)
    else:
        assert content and finish in ("stop", "length")


@pytest.mark.parametrize("kw,field", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    (dict(tools=TOOLS, tool_choice=NAMED, extra_body={"guided_regex": "a+"}), "guided_regex"),
])
def test_invalid_tool_fields_are_400_naming_the_field(client, kw, field):
    with pytest.raises(BadRequestError) as err:
        _create(client, messages=ASK, max_tokens=4, **kw)
    assert err.value.body["param"] == field and field in err.value.message


def test_auto_without_a_parser_is_400_naming_tool_choice(server):
    # the session's SmolLM2 server: no --enable-auto-tool-choice, no tool format in its template
    from conftest import API_KEY, MODEL as SMOLLM
    smol = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(BadRequestError) as err:
        smol.chat.completions.create(model=SMOLLM, messages=ASK, tools=TOOLS, max_tokens=4)
    assert err.value.body["param"] == "tool_choice", err.value.body
