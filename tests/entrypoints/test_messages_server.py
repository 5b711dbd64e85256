"""Anthropic's Messages API through the official anthropic SDK, against a live server on the
default model (Qwen2.5-Coder-0.5B-Instruct, hermes tool format): a tool round trip, stop
sequences, the max_tokens stop reason, count_tokens, the x-api-key header, and errors in
Anthropic's shape naming the field; streamed and not."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from conftest import QWEN, QWEN_KEY

MODEL, KEY = QWEN, QWEN_KEY  # conftest's qwen_server
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the current time in a time zone.",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                         "required": ["timezone"]}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
# the final turn: after a tool result the 0.5B model answers in words with this system prompt
ANSWER_SYSTEM = "You are a helpful assistant. After a tool result arrives, answer the user in " \
                "one plain sentence."


@pytest.fixture(scope="module")
def client(qwen_server):
    # the SDK sends the key as x-api-key, and anthropic-version on every request
    return anthropic.Anthropic(base_url=qwen_server.url, api_key=KEY, max_retries=0, timeout=120)


def _create(client, stream: bool, **kw):
    """The final Message, built by the SDK from the event stream when stream."""
    # this SDK's create() no longer takes temperature, top_p, top_k: sent as the API has them
    kw = {"model": MODEL, "extra_body": {"temperature": 0}, **kw}
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as events:
        kinds = [e.type for e in events]
        message = events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    return message


def _tool_uses(message):
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client, stream):
    first = _create(client, stream, messages=ASK, tools=[WEATHER, TIME], max_tokens=40,
                    tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = _tool_uses(first)
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input.get("city"), str) and use.id
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    final = _create(client, stream, system=ANSWER_SYSTEM, max_tokens=48, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": json.dumps({"city": use.input["city"],
                                                             "temperature_c": 18,
                                                             "sky": "sunny"})}]}])
    assert final.stop_reason in ("end_turn", "max_tokens") and not _tool_uses(final)
    text = "".join(b.text for b in final.content if b.type == "text")
    assert "<tool_call>" not in text
    assert "18" in text or "sunny" in text.lower(), text  # the tool's result reached the model


@pytest.mark.parametrize("stream", [False, True])
def test_any_makes_a_valid_call(client, stream):
    message = _create(client, stream, messages=[{"role": "user", "content": "Time in Tokyo?"}],
                      tools=[WEATHER, TIME], tool_choice={"type": "any"}, max_tokens=60)
    uses = _tool_uses(message)
    assert message.stop_reason == "tool_use" and uses
    for use in uses:
        assert use.name in ("get_weather", "get_time") and isinstance(use.input, dict)


def test_streamed_equals_plain(client):
    plain = _create(client, False, messages=COUNT, max_tokens=24)
    streamed = _create(client, True, messages=COUNT, max_tokens=24)
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert (streamed.stop_reason, plain.stop_reason) == ("max_tokens", "max_tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(client, stream):
    message = _create(client, stream, messages=COUNT, max_tokens=60, stop_sequences=["5"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "5"
    text = message.content[0].text
    assert "4" in text and "5" not in text  # Anthropic leaves the stop sequence out


def test_max_tokens_and_system_blocks(client):
    message = _create(client, False, messages=COUNT, max_tokens=3,
                      system=[{"type": "text", "text": "You count.",
                               "cache_control": {"type": "ephemeral"}}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL


def test_count_tokens_is_the_prompt_of_a_message(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER])
    counted = client.messages.count_tokens(**kw).input_tokens
    message = client.messages.create(max_tokens=1, **kw)
    assert counted == message.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens < counted


def test_stream_event_sequence(qwen_server):
    body = {"model": MODEL, "max_tokens": 40, "stream": True, "messages": ASK,
            "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    events = []
    with httpx.stream("POST", f"{qwen_server.url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for block in resp.read().decode().strip().split("\n\n"):
            name, data = block.split("\n")
            events.append((name.removeprefix("event: "), json.loads(data[len("data: "):])))
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start",
                                      "content_block_delta", "content_block_stop",
                                      "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] > 0 and start["content"] == []
    assert events[2][1]["content_block"]["type"] == "tool_use"
    assert json.loads(events[3][1]["delta"]["partial_json"])["city"]
    assert events[5][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[5][1]["usage"]["output_tokens"] > 0


def test_bearer_key_and_missing_key(qwen_server):
    body = {"model": MODEL, "max_tokens": 1, "messages": ASK}
    ok = httpx.post(f"{qwen_server.url}/v1/messages", json=body,
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=qwen_server.url, api_key="wrong", max_retries=0
                            ).messages.create(**body)
    assert err.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=None), "max_tokens"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]}]),
     "messages[0].content[0].cache_control"),
    (dict(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
    (dict(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (dict(metadata={"user_id": "u1", "team": "x"}), "metadata.team"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (dict(extra_body={"temperature": 1.5}), "temperature"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(output_config={"effort": "low"}), "output_config"),
    (dict(extra_body={"container": "c1"}), "container"),
    (dict(model="claude-nope"), "model"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "lang": "en"}]}]),
     "messages[0].content[0].lang"),
    (dict(tools=[WEATHER], tool_choice={"type": "auto", "name": "get_weather"}),
     "tool_choice.name"),
    (dict(stop_sequences=[""]), "stop_sequences"),
])
def test_errors_are_anthropic_shaped_and_name_the_field(client, kw, field):
    kw = {"model": MODEL, "max_tokens": 8, "messages": ASK, **kw}
    if kw["max_tokens"] is None:  # the SDK itself insists on max_tokens: go around it
        del kw["max_tokens"]
        kw = {"max_tokens": anthropic.omit, **kw}
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(**kw)
    body = err.value.body
    assert body["type"] == "error" and field in body["error"]["message"], body
    expected = "not_found_error" if field == "model" else "invalid_request_error"
    assert body["error"]["type"] == expected
    assert err.value.status_code == (404 if field == "model" else 400)


def test_metadata_user_id_is_accepted(client):
    message = client.messages.create(model=MODEL, max_tokens=2, messages=ASK,
                                     metadata={"user_id": "u1"})
    assert message.usage.output_tokens == 2
