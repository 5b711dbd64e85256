"""A chat request's tools: checks (400 naming the field), the tool_choice mode, the output
constraint that enforces `required` and a named function, and output text -> tool calls."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_common import OpenAIError
from pagedllm.entrypoints.openai.tool_parsers import StreamDelta, ToolCall, get_tool_parser
from pagedllm.sampling_params import StructuredOutputsParams

CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    """How a request with tools is rendered, constrained and parsed."""

    tools: Optional[list[dict[str, Any]]]  # what the chat template renders (None: nothing)
    choice: str  # none | auto | required | named
    name: Optional[str] = None  # the function of a named tool_choice
    parser: Any = None  # a tool_parsers parser, for auto
    constraint: Optional[StructuredOutputsParams] = None  # for required and named

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content or None, the calls) of one whole output."""
        if self.choice == "auto":
            return self.parser.extract(text)
        if self.choice == "named":
            try:
                json.loads(text)
            except ValueError:  # cut short by max_tokens: no call
                return text or None, []
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text or None, []
            return None, [ToolCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                          for it in items]
        return text, []

    def streamer(self):
        """A fresh incremental parser for one streamed choice."""
        if self.choice == "auto":
            return self.parser.streamer()
        return _WholeOutput(self) if self.choice in ("named", "required") else PassThrough()


class PassThrough:
    """Text without tools: all of it is content."""

    def feed(self, text: str) -> StreamDelta:
        return StreamDelta(content=text)

    def finish(self) -> StreamDelta:
        return StreamDelta()


class _WholeOutput:
    """Constrained output is JSON, not text for the user: held and turned into calls at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text = plan, ""

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        return StreamDelta()

    def finish(self) -> StreamDelta:
        content, calls = self.plan.extract(self.text)
        return StreamDelta(content=content or "", calls=calls)


MAX_TOOL_NAME_CHARS = 64


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise OpenAIError("tools must be a non-empty list of function tools", 400, "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise OpenAIError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                              400, "tools")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(f"tools[{i}].function.name must be a non-empty string", 400,
                              "tools")
        if len(fn["name"]) > MAX_TOOL_NAME_CHARS:
            # OpenAI's own limit; a 10 kB name made every step of tool_choice "required" slow
            raise OpenAIError(f"tools[{i}].function.name must be at most {MAX_TOOL_NAME_CHARS} "
                              f"characters (OpenAI's limit), got {len(fn['name'])}", 400, "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema object",
                              400, "tools")
    return tools


def _choice(tool_choice: Union[str, dict, None], names: list[str]) -> tuple[str, Optional[str]]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise OpenAIError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                              f"{tool_choice!r}", 400, "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError("tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                          400, "tool_choice")
    if name not in names:
        raise OpenAIError(f"tool_choice names function {name!r}, which is not in tools "
                          f"({', '.join(names)})", 400, "tool_choice")
    return "named", name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice=required: [{"name": <tool>, "parameters": <its schema>}]."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: ChatCompletionRequest, parser_name: Optional[str], auto_enabled: bool,
               exclude_when_none: bool = False) -> Optional[ToolPlan]:
    """The request's ToolPlan, None without tools; OpenAIError (400) naming the bad field."""
    if req.tools is None:
        if req.tool_choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", 400, "tool_choice")
        return None
    tools = _check_tools(req.tools)
    names = [t["function"]["name"] for t in tools]
    choice, name = _choice(req.tool_choice, names)
    if choice == "none":
        return ToolPlan(None if exclude_when_none else tools, "none")
    conflict = next(iter(req.constraint_fields()), None)
    if conflict is not None:
        raise OpenAIError(f"{conflict} cannot be combined with tools (tool_choice={choice!r}); "
                          "drop one of them", 400, conflict)
    if choice == "auto":
        if parser_name is None:
            raise OpenAIError('tool_choice "auto" needs a tool-call parser: this model\'s chat '
                              "template shows no tool-call format, so start the server with "
                              "--tool-call-parser (hermes or llama3_json); or send tool_choice "
                              '"required" or a named function', 400, "tool_choice")
        if not auto_enabled:
            raise OpenAIError('tool_choice "auto" is off on this server (started with '
                              "--no-enable-auto-tool-choice); send tool_choice \"required\" or "
                              "a named function", 400, "tool_choice")
        return ToolPlan(tools, "auto", parser=get_tool_parser(parser_name, names))
    if choice == "named":
        schema = _parameters(next(t for t in tools if t["function"]["name"] == name))
        field = "tool_choice"
    else:
        schema, field = _required_schema(tools, req.parallel_tool_calls is not False), "tools"
    try:
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                             field_name=field)
    except ValueError as err:
        raise OpenAIError(str(err), 400, field) from None
    return ToolPlan(tools, choice, name=name, constraint=constraint)
