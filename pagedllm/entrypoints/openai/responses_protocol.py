"""POST /v1/responses (OpenAI's Responses API): the request body, and its translation into the
one chat input path (a ChatCompletionRequest: messages, tools, tool_choice, response_format).

    input: "text" | [message | function_call | function_call_output | reasoning items]
    instructions          -> a system message first (not carried to a continuation)
    tools [{type: function, name, parameters}] -> chat tools; tool_choice alike
    text.format           -> response_format (json_schema, json_object, text)
    max_output_tokens     -> max_completion_tokens

Every field outside what is translated here is a 400 naming it, never dropped.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import ConfigDict, ValidationError

from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, Float, Int, RequestBody,
                                                  _described)
from pagedllm.entrypoints.openai.serving_common import OpenAIError

# fields the Responses API defines whose neutral value is accepted and any other refused
_NEUTRAL = {"include": (None, []), "background": (None, False), "truncation": (None, "disabled"),
            "top_logprobs": (None, 0), "max_tool_calls": (None,), "prompt": (None,),
            "conversation": (None,), "stream_options": (None,)}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "minLength": 1},
    "description": {"type": "string"}, "parameters": {"type": "object"}}}
_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text",
                                                                             "json_object"]}}},
    {"type": "object", "required": ["type", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": {"type": "string"},
        "schema": {"type": "object"}, "strict": {"type": "boolean"}}}]}


class ResponsesRequest(RequestBody):
    """The body of POST /v1/responses. The schema states what is served (no other field: the
    API's other fields are 400s naming them, check_fields)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = _described(...)
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = _described(items=_TOOL)
    tool_choice: Optional[Union[str, dict[str, Any]]] = _described(
        anyOf=[{"enum": ["auto", "none", "required"]},
               {"type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}])
    parallel_tool_calls: Optional[bool] = True
    text: Optional[dict[str, Any]] = _described(properties={"format": _FORMAT},
                                                additionalProperties=False)
    max_output_tokens: Optional[Int] = _described(minimum=1)
    temperature: Optional[Float] = _described(minimum=0, maximum=2)
    top_p: Optional[Float] = _described(exclusiveMinimum=0, maximum=1)
    reasoning: Optional[dict[str, Any]] = _described(
        properties={"effort": {"type": "null"}, "summary": {"type": "null"}},
        additionalProperties=False)
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = _described(pattern="^resp-[0-9a-f]{32}$")
    # informational: they change nothing in the answer
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None

    def check_fields(self) -> None:
        """A 400 naming the first field pagedllm does not implement (set to other than its
        neutral value), or that the Responses API does not define."""
        for name, value in (self.model_extra or {}).items():
            if name in _NEUTRAL and value in _NEUTRAL[name]:
                continue
            raise OpenAIError(f"{name} is not supported by pagedllm's /v1/responses", 400, name)
        for key, value in (self.reasoning or {}).items():
            if value is not None:  # effort and summary: the model thinks as it does
                raise OpenAIError(f"reasoning.{key} is not supported by pagedllm (a thinking "
                                  "model's reasoning comes as it is, in reasoning items)", 400,
                                  f"reasoning.{key}")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one is, after history (a stored response's conversation);
        check_fields first."""
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions is not None else [])
        messages += history + input_messages(self.input)
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:  # [] is no tools, as OpenAI takes it
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = _response_format(self.text)
        if fmt is not None:
            body["response_format"] = fmt
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "input"
            raise OpenAIError(f"{where}: {first.get('msg', 'invalid value')}", 400,
                              where) from None


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text; 400 naming a part of another
    type (images, files)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of text parts", 400, where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}[{j}].type must be one of {', '.join(_TEXT_PARTS[:2])} "
                              f"with a text; got {kind!r} (pagedllm serves text-only models)",
                              400, f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(f"{where}.{key} must be a string", 400, f"{where}.{key}")
    return value


def input_messages(items: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Chat messages of a Responses input: a function_call joins the assistant message before
    it (or opens one), a function_call_output is a tool message, a reasoning item's text goes
    with the next assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    thought: Optional[str] = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", 400, where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise OpenAIError(f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                  f"{role!r}", 400, f"{where}.role")
            msg = {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought is not None:
                msg["reasoning"], thought = thought, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where),
                                 "arguments": _field(item, "arguments", where)}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
                if thought is not None:
                    out[-1]["reasoning"], thought = thought, None
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise OpenAIError(f"{where}.type must be one of message, function_call, "
                              f"function_call_output, reasoning; got {kind!r}", 400,
                              f"{where}.type")
    if not out:
        raise OpenAIError("input must hold at least one message", 400, "input")
    return out


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise OpenAIError(f"{where}.type must be 'function' (pagedllm runs no built-in tools), "
                          f"got {kind!r}", 400, f"{where}.type")
    fn = {"name": tool.get("name")}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Union[str, dict[str, Any]]) -> Union[str, dict[str, Any]]:
    if isinstance(choice, str):
        return choice  # auto, none, required: checked by the chat path
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise OpenAIError("tool_choice must be 'auto', 'none', 'required' or "
                          "{'type': 'function', 'name': ...}", 400, "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """text.format as chat's response_format (None for plain text)."""
    unknown = sorted(set(text or {}) - {"format", "verbosity"})
    if unknown:
        raise OpenAIError(f"text.{unknown[0]} is not supported by pagedllm", 400,
                          f"text.{unknown[0]}")
    if (text or {}).get("verbosity") not in (None, "medium"):
        raise OpenAIError("text.verbosity is not supported by pagedllm", 400, "text.verbosity")
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise OpenAIError("text.format.type must be text, json_object or json_schema, got "
                          f"{fmt.get('type')!r}", 400, "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise OpenAIError("text.format.schema must be a JSON schema object", 400,
                          "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                   "schema": fmt["schema"],
                                                   "strict": fmt.get("strict")}}
