"""OpenAI's Responses API (POST /v1/responses) through the official openai SDK against a live
server on the default model (Qwen2.5-Coder-0.5B-Instruct): a tool round trip, a JSON-schema
answer, previous_response_id continuing a conversation, GET and cancel, streamed and not; every
refused or invalid field a 400 in OpenAI's error shape naming it; the store's bounds."""
from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from conftest import QWEN, QWEN_KEY
from pagedllm.entrypoints.openai.response_store import ResponseStore

MODEL = QWEN  # conftest's qwen_server
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
NAMED = {"type": "function", "name": "get_weather"}
SUM = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


AUTH = {"Authorization": f"Bearer {QWEN_KEY}"}


@pytest.fixture(scope="module")
def server(qwen_server):
    """conftest's qwen_server (a response store of 8)."""
    return qwen_server


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=QWEN_KEY, max_retries=0, timeout=120)


def _create(client, stream=False, **kw):
    """The finished response (a stream's response.completed / .incomplete one)."""
    kw = {"model": MODEL, "temperature": 0, "max_output_tokens": 40, **kw}
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client, stream):
    first = _create(client, stream, input="What is the weather like in Paris right now?",
                    tools=[WEATHER], tool_choice=NAMED)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})}
    # the continuation by id, and the same conversation sent as items
    by_id = _create(client, stream, previous_response_id=first.id, input=[result],
                    instructions="Answer the user in one plain sentence.")
    items = [{"role": "user", "content": "What is the weather like in Paris right now?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments}, result]
    by_items = _create(client, stream, input=items,
                       instructions="Answer the user in one plain sentence.")
    for answer in (by_id, by_items):
        assert answer.output[-1].type == "message" and answer.output_text.strip()
    assert by_id.output_text == by_items.output_text  # the same prompt either way


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer(client, stream):
    out = _create(client, stream, input="What is 2 + 3? Answer in JSON.",
                  text={"format": {"type": "json_schema", "name": "sum", "schema": SUM,
                                   "strict": True}})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SUM)


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_conversation(client, stream):
    first = _create(client, stream, input="My name is Ada Lovelace. Remember it.",
                    instructions="You are a helpful assistant.")
    second = _create(client, stream, input="What is my name?", previous_response_id=first.id)
    assert "Ada" in second.output_text
    assert second.previous_response_id == first.id
    fresh = _create(client, stream, input="What is my name?")
    assert "Ada" not in fresh.output_text  # the name came from the stored conversation
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_stream_text_events_add_up_to_the_response(client):
    events = list(client.responses.create(model=MODEL, input="Say hello.", temperature=0,
                                          max_output_tokens=12, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert done and done[0].text == text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens > 0


def test_cancel_a_running_response(server, client):
    seen: dict = {}

    def consume():
        with httpx.stream("POST", f"{server.url}/v1/responses", timeout=120, headers=AUTH, json={
                "model": MODEL, "input": "Count from 1 to 500, one number per line.",
                "max_output_tokens": 1500, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    seen.setdefault("id", event.get("response", {}).get("id"))
                    if event["type"] == "response.output_text.delta":
                        seen["started"].set()
                    seen["last"] = event

    seen["started"] = threading.Event()
    worker = threading.Thread(target=consume)
    worker.start()
    assert seen["started"].wait(60)
    cancelled = client.responses.cancel(seen["id"])
    assert cancelled.status == "cancelled"
    worker.join(60)
    assert seen["last"]["type"] == "response.incomplete"
    assert seen["last"]["response"]["status"] == "cancelled"
    with pytest.raises(NotFoundError):  # a cancelled response is not stored
        client.responses.retrieve(seen["id"])
    server.wait_idle()


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"},
      "tools": [WEATHER]}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_refused_fields_are_400s_naming_them(server, body, param):
    resp = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, headers=AUTH,
                      timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_unknown_ids_are_404s(client):
    with pytest.raises(NotFoundError) as err:
        client.responses.retrieve("resp-nope")
    assert err.value.body["param"] == "response_id"
    with pytest.raises(NotFoundError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp-nope")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(NotFoundError):
        client.responses.cancel("resp-nope")


def test_finished_response_cannot_be_cancelled(client):
    out = _create(client, input="Say hi.", max_output_tokens=4)
    with pytest.raises(BadRequestError) as err:
        client.responses.cancel(out.id)
    assert err.value.body["param"] == "response_id"


def test_store_false_is_not_kept(client):
    out = _create(client, input="Say hi.", max_output_tokens=4, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(out.id)


def _body(rid: str, size: int) -> dict:
    return {"id": rid, "pad": "x" * size}


def test_store_bounds_entries_and_bytes_least_recently_used_first():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for rid in "abc":
        assert store.put(_body(rid, 100), [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_body("d", 100), [])
    assert [r for r in "abcd" if store.get(r)] == ["a", "c", "d"]
    store.put(_body("e", 9_800), [])  # over the bytes with the others: the oldest go
    assert [r for r in "acde" if store.get(r)] == ["d", "e"] and store.num_bytes <= 10_000
    assert not store.put(_body("f", 20_000), [])  # alone over the bound: not kept
    assert store.get("f") is None
    with pytest.raises(ValueError, match="--responses-store-max-entries"):
        ResponseStore(max_entries=-1)
