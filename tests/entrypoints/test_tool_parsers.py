"""The tool-call parsers on literal model outputs, whole and streamed character by character."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                                      get_tool_parser, parser_for_template)

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser, text):
    """Feed text one character at a time: (all content, calls, the feed step of each call)."""
    stream, content, calls, steps = parser.streamer(), "", [], []
    for i, ch in enumerate(text):
        delta = stream.feed(ch)
        content += delta.content
        calls += delta.calls
        steps += [i] * len(delta.calls)
    last = stream.finish()
    return content + last.content, calls + last.calls, steps


HERMES_CASES = [
    ("Just text, no calls.", "Just text, no calls.", []),
    (CALL_A, None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + CALL_A + "\n" + CALL_B + "\n", "Let me check.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ('<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>', []),
    ("a < b and <tool", "a < b and <tool", []),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # unclosed
    # bare call objects, no tags (what Qwen2.5-Coder-0.5B GGUFs often write)
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "f", "arguments": {}}',
     None, [("get_weather", {"city": "Paris"}), ("f", {})]),
    ('{"name": "f", "arguments": {}}\n{"temperature_c": 18}',
     '{"name": "f", "arguments": {}}\n{"temperature_c": 18}', []),
    ('{"name": "Bob"}', '{"name": "Bob"}', []),
    ('{"a": 1} then ' + CALL_A, '{"a": 1} then', [("get_weather", {"city": "Paris"})]),
]


def test_bare_json_is_a_call_only_if_it_names_a_request_tool():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    known = get_tool_parser("hermes", ["get_weather"])
    assert _calls(known.extract(text)[1]) == [("get_weather", {"city": "Paris"})]
    other = get_tool_parser("hermes", ["get_time"])  # a JSON answer, not a call of this request
    assert other.extract(text) == (text, [])
    tagged = "<tool_call>" + text + "</tool_call>"  # tags make it a call whatever its name
    assert _calls(other.extract(tagged)[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_streamed(text, content, calls):
    parser = HermesToolParser()
    got_content, got_calls = parser.extract(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    s_content, s_calls, _ = _streamed(parser, text)
    assert (s_content.strip() or None, _calls(s_calls)) == (content, calls)


def test_hermes_stream_sends_text_first_and_each_call_when_its_block_closes():
    parser = HermesToolParser()
    text = "Sure.\n" + CALL_A + "\n" + CALL_B
    stream = parser.streamer()
    seen = []
    for i, ch in enumerate(text):
        delta = stream.feed(ch)
        if delta.content:
            seen.append(("content", i, delta.content))
        seen += [("call", i, c.name) for c in delta.calls]
    assert seen[-2:] == [("call", len("Sure.\n" + CALL_A) - 1, "get_weather"),
                         ("call", len(text) - 1, "get_time")]
    assert "".join(s[2] for s in seen if s[0] == "content") == "Sure."
    assert all(s[1] < len("Sure.") for s in seen if s[0] == "content")
    ids = [c.id for c in HermesToolParser().extract(text)[1]]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": 2}}', None,
     [("f", {}), ("g", {"a": 2})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(text, content, calls):
    parser = Llama3JsonToolParser()
    got_content, got_calls = parser.extract(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    s_content, s_calls, _ = _streamed(parser, text)
    assert (s_content or None, _calls(s_calls)) == (content, calls)


def test_llama3_json_streams_plain_text_as_it_comes():
    stream = Llama3JsonToolParser().streamer()
    assert stream.feed("Hel").content == "Hel" and stream.feed("lo").content == "lo"


def test_parser_names_and_template_pick():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")
    assert parser_for_template("... <tool_call>\\n{{ tool_call | tojson }} ...") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


def test_serve_picks_the_parser_from_the_template_and_logs_it(caplog):
    import argparse
    import logging

    from pagedllm.entrypoints.serve import _tool_parser

    def args(**kw):
        return argparse.Namespace(**{"tool_call_parser": None, "enable_auto_tool_choice": False,
                                     **kw})

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert _tool_parser(args(), "... <tool_call> ...") == "hermes"
    assert "'hermes' parser" in caplog.text
    assert _tool_parser(args(tool_call_parser="llama3_json"), "<tool_call>") == "llama3_json"
    assert _tool_parser(args(), "{{ messages }}") is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        _tool_parser(args(enable_auto_tool_choice=True), "{{ messages }}")


def test_llama3_json_streams_each_call_when_its_json_completes():
    stream = Llama3JsonToolParser().streamer()
    first = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}'
    pieces = [first[:20], first[20:], '; {"name": "g", ', '"parameters": {}}']
    got = [[c.name for c in stream.feed(p).calls] for p in pieces]
    assert got == [[], ["f"], [], ["g"]]  # f goes out before g is written
    last = stream.finish()
    assert (last.content, last.calls) == ("", [])


def test_llama3_json_tag_and_no_call_is_content_unchanged():
    text = '<|python_tag|>{"not": "a call"}'
    content, calls, _ = _streamed(Llama3JsonToolParser(), text)
    assert (content, calls) == (text, [])


def test_auto_tool_choice_is_on_once_a_parser_is_known_unless_turned_off(caplog):
    import logging

    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.serve import _auto_tool_choice

    def parsed(*flags):
        return build_parser().parse_args(["serve", *flags])

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert _auto_tool_choice(parsed(), "hermes") is True
    assert "--no-enable-auto-tool-choice" in caplog.text
    assert _auto_tool_choice(parsed(), None) is False
    assert _auto_tool_choice(parsed("--no-enable-auto-tool-choice"), "hermes") is False
    assert _auto_tool_choice(parsed("--enable-auto-tool-choice"), "hermes") is True


def test_auto_refusals_name_only_what_is_missing():
    from pagedllm.entrypoints.openai.chat_tools import plan_tools
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_common import OpenAIError

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool])
    with pytest.raises(OpenAIError) as no_parser:
        plan_tools(req, None, True)
    assert "--tool-call-parser" in no_parser.value.message
    assert "--enable-auto-tool-choice" not in no_parser.value.message
    with pytest.raises(OpenAIError) as off:
        plan_tools(req, "hermes", False)
    assert "--no-enable-auto-tool-choice" in off.value.message
    assert "--tool-call-parser" not in off.value.message
    assert plan_tools(req, "hermes", True).choice == "auto"


def test_a_tool_name_over_openais_64_characters_is_a_400_naming_tools():
    from pagedllm.entrypoints.openai.chat_tools import plan_tools
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_common import OpenAIError

    def req(name):
        tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                     tool_choice="required")

    assert plan_tools(req("f" * 64), "hermes", True).choice == "required"
    with pytest.raises(OpenAIError) as err:
        plan_tools(req("f" * 10_000), "hermes", True)
    assert err.value.param == "tools" and "at most 64 characters" in err.value.message
