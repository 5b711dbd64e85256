"""The Messages API's translation, without a server: a Messages request as the chat request it
becomes, and the chat result (content, tool calls, reasoning) as Anthropic's content blocks and
stream events, on fixed values."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.anthropic.errors import anthropic_error_body, error_body
from pagedllm.entrypoints.anthropic.protocol import MessagesRequest
from pagedllm.entrypoints.anthropic.serving_messages import (BlockStream, blocks_of,
                                                            content_blocks, stop_of)
from pagedllm.entrypoints.openai.serving_common import OpenAIError
from pagedllm.outputs import CompletionOutput

CALL = {"id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _request(**kw) -> MessagesRequest:
    return MessagesRequest(**{"model": "m", "max_tokens": 8,
                              "messages": [{"role": "user", "content": "hi"}], **kw})


def test_conversation_with_tool_use_and_tool_result():
    chat = _request(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                    messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "earlier thoughts", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call-1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call-1",
             "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}]).to_chat()
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call-1"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_sampling_tools_and_prefill():
    chat = _request(messages=[{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "Hello"}],
                    tools=[{"name": "f", "input_schema": {"type": "object"}}],
                    tool_choice={"type": "any", "disable_parallel_tool_use": True},
                    stop_sequences=["x"], temperature=0.5, top_p=0.9, top_k=0, stream=True,
                    thinking={"type": "disabled"}).to_chat()
    assert chat.tools == [{"type": "function",
                           "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert (chat.stop, chat.temperature, chat.top_p, chat.top_k) == (["x"], 0.5, 0.9, -1)
    assert chat.max_tokens == 8 and chat.stream
    assert chat.continue_final_message and not chat.add_generation_prompt  # prefill
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    named = _request(tools=[{"name": "f", "input_schema": {}}],
                     tool_choice={"type": "tool", "name": "f"}).to_chat()
    assert named.tool_choice == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("content,field", [
    ([{"type": "document", "source": {}}], "messages[0].content[0].type"),
    ([{"type": "tool_use", "id": "a", "name": "f", "input": {}}], "messages[0].content[0].type"),
    ([{"type": "tool_result", "content": "x"}], "messages[0].content[0].tool_use_id"),
    ([{"type": "tool_result", "tool_use_id": "a",
       "content": [{"type": "image", "source": {}}]}], "messages[0].content[0].content[0].type"),
])
def test_unsupported_blocks_name_themselves(content, field):
    with pytest.raises(OpenAIError) as err:
        _request(messages=[{"role": "user", "content": content}]).to_chat()
    assert err.value.param == field and err.value.status == 400


@pytest.mark.parametrize("fields,where", [
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]),
     "messages[0].content[0].x"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "9d"}}]}]),
     "messages[0].content[0].cache_control.ttl"),
    (dict(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}, "caller": {"type": "x"}}]}]),
     "messages[1].content[0].caller"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "x", "extra": True}]}]),
     "messages[0].content[0].extra"),
    (dict(tools=[{"name": "f", "input_schema": {}, "strict": True}]), "tools[0].strict"),
    (dict(tool_choice={"type": "auto", "name": "f"}), "tool_choice.name"),
    (dict(tool_choice={"type": "any", "disable_parallel_tool_use": "yes"}),
     "tool_choice.disable_parallel_tool_use"),
    (dict(thinking={"type": "disabled", "budget_tokens": 5}), "thinking.budget_tokens"),
])
def test_unknown_fields_inside_blocks_name_themselves(fields, where):
    with pytest.raises(OpenAIError) as err:
        _request(**fields).to_chat()
    assert err.value.param == where and err.value.status == 400


def test_null_fields_of_an_sdk_dump_are_absent():
    # a response's tool_use and text blocks sent back as the SDK's model_dump() writes them
    chat = _request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": "ok", "citations": None},
        {"type": "tool_use", "id": "call-1", "name": "get_weather", "input": {"city": "Paris"},
         "caller": None, "toolset_name": None}]}]).to_chat()
    assert chat.messages[1].tool_calls == [CALL] and chat.messages[1].content == "ok"


def test_reasoning_maps_to_a_thinking_block():
    # what the chat path's result holds once a reasoning parser splits the thinking off
    message = {"role": "assistant", "reasoning": "The user wants Paris.",
               "content": "Checking.", "tool_calls": [CALL]}
    assert content_blocks(message) == [
        {"type": "thinking", "thinking": "The user wants Paris.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call-1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert content_blocks({"role": "assistant", "content": None}) == []


def _events(lines: list[str]) -> list[tuple[str, dict]]:
    out = []
    for line in lines:
        name, data = line.strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stream_blocks_from_chat_deltas():
    blocks, lines = BlockStream(), []
    for delta in ({"reasoning": "Hm, "}, {"reasoning": "Paris."}, {"content": "Ok"},
                  {"tool_calls": [{"index": 0, **CALL}]}):
        for kind, value in blocks_of(delta):
            lines += blocks.feed(kind, value)
    lines += blocks.close()
    got = [(name, data.get("index"), data.get("delta") or data.get("content_block"))
           for name, data in _events(lines)]
    assert got == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "Hm, "}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "Paris."}),
        ("content_block_delta", 0, {"type": "signature_delta", "signature": ""}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "Ok"}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "tool_use", "id": "call-1", "name": "get_weather",
                                    "input": {}}),
        ("content_block_delta", 2, {"type": "input_json_delta",
                                    "partial_json": '{"city": "Paris"}'}),
        ("content_block_stop", 2, None)]


def test_stop_reasons():
    comp = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                            logprobs=None, finish_reason="stop", stop_reason="END")
    assert stop_of("stop", comp) == ("stop_sequence", "END")
    comp.stop_reason = None
    assert stop_of("stop", comp) == ("end_turn", None)
    assert stop_of("length", comp) == ("max_tokens", None)
    assert stop_of("tool_calls", comp) == ("tool_use", None)


def test_error_shape_by_path():
    err = OpenAIError("must be a string", 400, "messages[0].content")
    assert anthropic_error_body(err) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages[0].content: must be a string"}}
    assert error_body("/v1/messages/count_tokens", OpenAIError("busy", 503))["error"]["type"] \
        == "overloaded_error"
    assert error_body("/v1/chat/completions", err) == err.body()
