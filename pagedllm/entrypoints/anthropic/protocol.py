"""Request bodies of Anthropic's Messages API and their translation into one chat request.

Everything a Messages request asks is said again as a ChatCompletionRequest, so templating,
tools, sampling checks and the engine request come from the chat path (serving_chat), never a
copy. A field or block pagedllm does not implement is a 400 naming it."""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, Float, Int, RequestBody
from pagedllm.entrypoints.openai.serving_common import OpenAIError

# a cache breakpoint: pagedllm's prefix cache keeps every prompt prefix (LRU), marked or not
_CACHE_CONTROL = "ephemeral"
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": a named one
# blocks of earlier assistant turns that Anthropic itself strips from the prompt
_DROPPED_BLOCKS = ("thinking", "redacted_thinking")


class MessageParam(RequestBody):
    """One turn of a conversation: a role and a string or content blocks."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class CountTokensRequest(RequestBody):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model_config = ConfigDict(extra="forbid")  # Anthropic's API refuses unknown fields too
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """This request as a chat completion request (400 naming the Anthropic field)."""
        messages = _system(self.system) + _conversation(self.messages)
        prefill = self.messages[-1].role == "assistant"  # Anthropic continues that turn
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "add_generation_prompt": not prefill,
            "continue_final_message": prefill, **_thinking(self.thinking), **sampling}
        if self.tools is not None:
            fields["tools"] = _tools(self.tools)
        if self.tool_choice is not None:
            fields.update(_tool_choice(self.tool_choice))
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as err:  # the fields above are checked: a bug if it comes here
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise OpenAIError(f"{where}: {first['msg']}", 400, where) from None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[Float] = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: Optional[Float] = Field(None, gt=0, le=1)
    top_k: Optional[Int] = Field(None, ge=0)
    metadata: Optional[dict[str, Any]] = None
    # automatic caching of the whole prompt: what the prefix cache does with every prompt
    cache_control: Optional[dict[str, Any]] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None  # one tier here: either

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request that generates this message."""
        _check_cache_control({"cache_control": self.cache_control}, "body")
        if self.metadata is not None and set(self.metadata) - {"user_id"}:
            bad = sorted(set(self.metadata) - {"user_id"})[0]
            raise OpenAIError(f"metadata.{bad} is not a Messages API field (metadata takes "
                              "user_id only)", 400, f"metadata.{bad}")
        # top_k 0 is Anthropic's "off"; pagedllm's and vLLM's off is -1
        top_k = None if self.top_k is None else (self.top_k or -1)
        return self.chat_request(
            max_tokens=self.max_tokens, stop=self.stop_sequences, stream=self.stream,
            temperature=self.temperature, top_p=self.top_p, top_k=top_k)


def _refuse(where: str, what: str) -> OpenAIError:
    return OpenAIError(f"{where}: {what}", 400, where)


def _only(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """A 400 naming the first key of obj outside allowed (Anthropic refuses unknown fields);
    a null one is taken as absent (the SDK's model_dump() of a response block writes its unset
    fields, caller and toolset_name say, as null)."""
    unknown = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if unknown:
        raise _refuse(f"{where}.{unknown[0]}", "is not a field of this object in the Messages "
                      "API, or not one pagedllm supports")


def _check_cache_control(block: dict[str, Any], where: str) -> None:
    cache = block.get("cache_control")
    if cache is not None and (not isinstance(cache, dict) or cache.get("type") != _CACHE_CONTROL):
        raise _refuse(f"{where}.cache_control", f"must be {{'type': '{_CACHE_CONTROL}'}}")
    if cache is not None:  # ttl: how long Anthropic keeps it; the prefix cache keeps it LRU
        _only(cache, ("type", "ttl"), f"{where}.cache_control")
        if cache.get("ttl") not in (None, "5m", "1h"):
            raise _refuse(f"{where}.cache_control.ttl", "must be '5m' or '1h'")


def _text_of(block: Any, where: str) -> str:
    """A text block's text; anything else (image, document, search_result...) refused by name."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _refuse(where, "must be a content block object with a type")
    if block["type"] != "text":
        raise _refuse(f"{where}.type", f"{block['type']!r} blocks are not supported by "
                      "pagedllm (text, tool_use and tool_result are)")
    if not isinstance(block.get("text"), str):
        raise _refuse(f"{where}.text", "must be a string")
    if block.get("citations"):
        raise _refuse(f"{where}.citations", "citations are not supported by pagedllm")
    _only(block, ("type", "text", "cache_control", "citations"), where)
    _check_cache_control(block, where)
    return block["text"]


def _system(system: Union[str, list[dict[str, Any]], None]) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    text = "\n\n".join(_text_of(b, f"system[{i}]") for i, b in enumerate(system))
    return [{"role": "system", "content": text}]


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_result block as the chat path's tool message answering that call."""
    if not isinstance(block.get("tool_use_id"), str):
        raise _refuse(f"{where}.tool_use_id", "must be the id of the tool_use it answers")
    _only(block, ("type", "tool_use_id", "content", "is_error", "cache_control"), where)
    _check_cache_control(block, where)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_of(b, f"{where}.content[{j}]") for j, b in enumerate(content))
    elif not isinstance(content, str):
        raise _refuse(f"{where}.content", "must be a string or a list of text blocks")
    if block.get("is_error"):  # the chat template has no error flag: the text says so
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_use block as an OpenAI tool call of the assistant's message."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _refuse(where, "a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise _refuse(f"{where}.input", "must be an object")
    _only(block, ("type", "id", "name", "input", "cache_control"), where)
    _check_cache_control(block, where)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"],
                         "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _turn(i: int, m: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results first (tool messages),
    then its text; an assistant turn's text with its tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if m.role == "assistant" and kind in _DROPPED_BLOCKS:
            continue
        if m.role == "assistant" and kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif m.role == "user" and kind == "tool_result":
            results.append(_tool_result(block, where))
        elif kind in ("tool_use", "tool_result"):
            raise _refuse(f"{where}.type", f"{kind} blocks belong in "
                          f"{'assistant' if kind == 'tool_use' else 'user'} turns")
        else:
            texts.append(_text_of(block, where))
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _conversation(messages: list[MessageParam]) -> list[dict[str, Any]]:
    return [msg for i, m in enumerate(messages) for msg in _turn(i, m)]


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's custom tools (name, description, input_schema) as OpenAI function tools."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":  # Anthropic's server and client tools (bash, web_search...)
            raise _refuse(f"tools[{i}].type", f"{kind!r} tools are not supported by pagedllm "
                          "(custom tools with an input_schema are)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _refuse(f"tools[{i}].name", "must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            raise _refuse(f"tools[{i}].input_schema", "must be a JSON schema object")
        _only(tool, ("type", "name", "description", "input_schema", "cache_control"),
              f"tools[{i}]")
        _check_cache_control(tool, f"tools[{i}]")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """tool_choice auto / any / tool / none as the chat request's tool_choice and
    parallel_tool_calls."""
    kind = choice.get("type")
    _only(choice, ("type", "name", "disable_parallel_tool_use") if kind == "tool"
          else ("type", "disable_parallel_tool_use"), "tool_choice")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise _refuse("tool_choice.disable_parallel_tool_use", "must be a boolean")
    out: dict[str, Any] = {"parallel_tool_calls": not choice.get("disable_parallel_tool_use")}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice.name", "a tool_choice of type 'tool' names the tool")
        return {**out, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    if kind not in _TOOL_CHOICES:
        raise _refuse("tool_choice.type", f"must be one of auto, any, tool, none; got {kind!r}")
    return {**out, "tool_choice": _TOOL_CHOICES[kind]}


def _thinking(thinking: Optional[dict[str, Any]]) -> dict[str, Any]:
    """thinking {'type': 'disabled'} turns the template's thinking off (Qwen3's
    enable_thinking); a budget is not something pagedllm can hold a model to."""
    if thinking is None:
        return {}
    if thinking.get("type") == "disabled":
        _only(thinking, ("type",), "thinking")
        return {"chat_template_kwargs": {"enable_thinking": False}}
    raise _refuse("thinking", "only {'type': 'disabled'} is supported: pagedllm does not hold "
                  "a model to a thinking budget (a thinking model thinks as its chat template "
                  "says, and its thinking comes back as thinking blocks)")
