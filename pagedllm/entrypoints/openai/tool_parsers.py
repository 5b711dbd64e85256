"""Tool-call parsers (vLLM's names): model text -> content and function calls, whole or streamed.

hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Qwen2 / Qwen2.5)
llama3_json  {"name": ..., "parameters": {...}} as the whole output, maybe after <|python_tag|>
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class ToolCall:
    """One function call: its id, the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's message.tool_calls[i]."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one piece of streamed text yields: content to send now and calls completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _call_from_json(text: str, args_keys: tuple[str, ...]) -> Optional[ToolCall]:
    """A call from one JSON object {"name": ..., <args key>: {...}}, or None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models emit the arguments already as JSON text
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(body: str, args_keys: tuple[str, ...], separators: str,
                need_args: bool = False) -> Optional[list[ToolCall]]:
    """The calls when body is nothing but JSON call objects between separators, else None."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    body = body.strip()
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        if need_args and not (isinstance(obj, dict) and any(k in obj for k in args_keys)):
            return None
        call = _call_from_json(json.dumps(obj), args_keys)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in separators:
            pos += 1
    return calls or None


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (may start it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser:
    """<tool_call>JSON</tool_call> blocks anywhere in the text; a block whose JSON is not a call
    stays content. An output that is nothing but bare call objects ({"name", "arguments"}, no
    tags) counts as calls too: small Qwen2.5 models (the 0.5B GGUFs) often drop the tags."""

    START, END = "<tool_call>", "</tool_call>"
    ARGS = ("arguments", "parameters")

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content outside the calls or None, the calls) of a whole output."""
        stream = self.streamer()
        delta, last = stream.feed(text), stream.finish()
        content = (delta.content + last.content).strip()
        return content or None, delta.calls + last.calls

    def streamer(self) -> "HermesStreamer":
        """A fresh incremental parser for one choice."""
        return HermesStreamer(self)


class HermesStreamer:
    """Text outside the tags streams as content; a block is held from its start tag and comes
    out as one call when it closes. Whitespace next to a call is dropped."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.buffer = ""  # text not yet sent: a held tag prefix, a held whitespace, or a block
        self.in_call = False
        self.bare: Optional[bool] = None  # output starts with "{": held whole (bare calls?)
        self.held = ""

    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of generated text."""
        if self.bare is False:
            return self._feed_tags(text)
        self.held += text
        head = self.held.lstrip()
        if head:
            self.bare = head.startswith("{")
        if self.bare is False:
            text, self.held = self.held, ""
            return self._feed_tags(text)
        return StreamDelta()

    def _feed_tags(self, text: str) -> StreamDelta:
        self.buffer += text
        out = StreamDelta()
        while True:
            if self.in_call:
                end = self.buffer.find(self.parser.END)
                if end < 0:
                    return out
                self._close(self.buffer[:end], out, closed=True)
                self.buffer = self.buffer[end + len(self.parser.END):].lstrip()
                self.in_call = False
                continue
            start = self.buffer.find(self.parser.START)
            if start < 0:
                keep = held_prefix(self.buffer, self.parser.START)
                text_part = self.buffer[:len(self.buffer) - keep]
                # trailing whitespace waits: it is dropped if a call follows
                stripped = text_part.rstrip()
                out.content += stripped
                self.buffer = text_part[len(stripped):] + self.buffer[len(text_part):]
                return out
            out.content += self.buffer[:start].rstrip()
            self.buffer = self.buffer[start + len(self.parser.START):]
            self.in_call = True

    def finish(self) -> StreamDelta:
        """The end of the output: an unclosed block still counts if its JSON is a call."""
        if self.bare:
            held, self.held, self.bare = self.held, "", False
            calls = _json_calls(held, self.parser.ARGS, " \n\t", need_args=True)
            names = getattr(self.parser, "tool_names", None)
            # untagged JSON is a call only if it names the request's tools (else it is content)
            if calls and (names is None or all(c.name in names for c in calls)):
                return StreamDelta(calls=calls)
            out = self._feed_tags(held)
            last = self._finish_tags()
            return StreamDelta(out.content + last.content, out.calls + last.calls)
        if self.held:  # only whitespace came
            self.held = ""
        return self._finish_tags()

    def _finish_tags(self) -> StreamDelta:
        out = StreamDelta()
        if self.in_call:
            self._close(self.buffer, out, closed=False)
        elif self.buffer.strip():  # held whitespace at the very end is dropped
            out.content = self.buffer
        self.buffer, self.in_call = "", False
        return out

    def _close(self, body: str, out: StreamDelta, closed: bool) -> None:
        call = _call_from_json(body.strip(), self.parser.ARGS)
        if call is not None:
            out.calls.append(call)
        else:  # not a call: the block is content, tags included
            out.content += self.parser.START + body + (self.parser.END if closed else "")


class Llama3JsonToolParser:
    """The whole output is one JSON call (or several joined by ';'), maybe after <|python_tag|>;
    anything else is content."""

    TAG = "<|python_tag|>"
    ARGS = ("parameters", "arguments")

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content or None, the calls) of a whole output."""
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        calls = _json_calls(body, self.ARGS, "; \n\t") if body.startswith("{") else None
        if calls:
            return None, calls
        return text or None, []

    def streamer(self) -> "Llama3JsonStreamer":
        """A fresh incremental parser for one choice."""
        return Llama3JsonStreamer(self)


class Llama3JsonStreamer:
    """An output that starts like JSON (or the python tag) is held, and each call goes out as
    soon as its JSON object is complete; any other output streams as content."""

    SEPARATORS = "; \n\t"

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.holding: Optional[bool] = None  # undecided until the first non-space text
        self.calls_sent = 0
        self.held_head = ""  # what went before the JSON: leading space, the python tag
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of generated text."""
        if self.holding is False:
            return StreamDelta(content=text)
        self.buffer += text
        if self.holding:
            return self._complete_calls()
        head = self.buffer.lstrip()
        if not head or self.parser.TAG.startswith(head):
            return StreamDelta()
        self.holding = head.startswith("{") or head.startswith(self.parser.TAG)
        if self.holding:
            everything, self.buffer = self.buffer, head.removeprefix(self.parser.TAG)
            self.held_head = everything[:len(everything) - len(self.buffer)]  # spaces, tag
            return self._complete_calls()
        out, self.buffer = StreamDelta(content=self.buffer), ""
        return out

    def _complete_calls(self) -> StreamDelta:
        """The calls whose JSON objects are now complete at the front of the buffer."""
        out = StreamDelta()
        while True:
            body = self.buffer.lstrip(self.SEPARATORS)
            try:
                obj, end = self._decoder.raw_decode(body)
            except ValueError:
                return out  # incomplete (or not JSON: finish() decides)
            call = _call_from_json(json.dumps(obj), self.parser.ARGS)
            if call is None:
                return out  # a JSON object that is no call: finish() decides
            out.calls.append(call)
            self.calls_sent += 1
            self.buffer = body[end:]

    def finish(self) -> StreamDelta:
        """The end of the output: what is left is more calls or, failing that, content."""
        text, self.buffer = self.buffer, ""
        if not text.strip(self.SEPARATORS):
            return StreamDelta()
        if self.calls_sent == 0:
            text = self.held_head + text  # content, if it is no call, is the output as it was
        content, calls = self.parser.extract(text)
        return StreamDelta(content="" if calls else (content or ""), calls=calls)


PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str, tool_names: Optional[Iterable[str]] = None):
    """The parser registered as name; ValueError naming --tool-call-parser otherwise.
    tool_names: the request's tools, which untagged (bare JSON) calls must name."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {name!r}")
    parser = PARSERS[name]()
    parser.tool_names = None if tool_names is None else frozenset(tool_names)
    return parser


def parser_for_template(template: Optional[str]) -> Optional[str]:
    """The parser a chat template's tool format implies, or None when it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return "llama3_json"
    return None
