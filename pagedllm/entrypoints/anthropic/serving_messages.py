"""POST /v1/messages and /v1/messages/count_tokens over the chat path.

The request becomes a ChatCompletionRequest (protocol.py) and runs through serving_chat's
start_chat; its answer is read from what the chat path makes of the output: the chat message
(chat_message, non-streamed) or the chat stream's choice splitter (ChatRun.choice_stream:
reasoning, answer, tool calls), each mapped to Anthropic's content blocks by blocks_of. Tool
parsing, reasoning splitting, templating and stream bookkeeping stay in the chat path."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from pagedllm.entrypoints.anthropic.errors import anthropic_error_body
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.serving_chat import (ChatRun, chat_message, count_chat_tokens,
                                                      start_chat)
from pagedllm.entrypoints.openai.serving_common import OpenAIError, ServerContext, stream_error
from pagedllm.outputs import CompletionOutput, RequestOutput

# the chat request's field names in errors, said as the Messages API says them
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
# chat finish_reason -> Anthropic stop_reason ("stop" is end_turn or stop_sequence)
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def thinking_block(reasoning: str) -> dict[str, Any]:
    """The chat result's reasoning text (a reasoning parser's split) as Anthropic's thinking
    block. Its signature is empty: nothing here signs thinking, and a client sending the block
    back in a later turn has it dropped, as Anthropic drops earlier turns' thinking."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def blocks_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """A chat message, or one streamed chat delta, as Anthropic content in order: ("thinking",
    text) from its reasoning, ("text", text) from its content, ("tool_use", call) per tool call."""
    pieces: list[tuple[str, Any]] = []
    if message.get("reasoning"):
        pieces.append(("thinking", message["reasoning"]))
    if message.get("content"):
        pieces.append(("text", message["content"]))
    pieces += [("tool_use", call) for call in message.get("tool_calls") or []]
    return pieces


def _tool_use_block(call: dict[str, Any], with_input: bool = True) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if with_input else {}
    except ValueError:  # the parser passes only calls whose arguments are JSON; be sure
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat message as a Messages response's content."""
    out = []
    for kind, value in blocks_of(message):
        if kind == "thinking":
            out.append(thinking_block(value))
        elif kind == "text":
            out.append({"type": "text", "text": value})
        else:
            out.append(_tool_use_block(value))
    return out


def stop_of(finish_reason: Optional[str], comp: CompletionOutput
            ) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) from the chat finish_reason and the output's stop_reason
    (the stop string matched, when one was)."""
    if finish_reason is None:
        return None, None
    if finish_reason in _STOP_REASONS:
        return _STOP_REASONS[finish_reason], None
    if isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    return "end_turn", None


async def count_tokens(ctx: ServerContext, req: CountTokensRequest) -> dict[str, int]:
    """{"input_tokens": n}: the templated prompt with its tools, as a Messages request sends it."""
    try:
        return {"input_tokens": await count_chat_tokens(ctx, req.chat_request())}
    except OpenAIError as err:
        raise err.renamed(_FIELDS) from None


async def create_message(ctx: ServerContext, req: MessagesRequest,
                         client: Optional[str] = None):
    """The Message object, or an async iterator of Anthropic's SSE events when req.stream."""
    chat = req.to_chat()
    try:
        run = await start_chat(ctx, chat, client, prefix="msg")
    except OpenAIError as err:
        raise err.renamed(_FIELDS) from None
    if req.stream:
        return _events(run, run.choice_stream(ctx, chat))
    final: Optional[RequestOutput] = None
    async for final in run.gen:
        pass
    comp = final.outputs[0]
    message, finish = chat_message(run.plan, run.reasoning, comp)
    stop_reason, stop_sequence = stop_of(finish, comp)
    return {**_message_head(run), "content": content_blocks(message),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(run.prompt_token_ids),
                      "output_tokens": len(comp.token_ids)}}


def _message_head(run: ChatRun) -> dict[str, Any]:
    return {"id": run.request_id, "type": "message", "role": "assistant", "model": run.model}


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's stream: its name and its JSON data."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class BlockStream:
    """Anthropic's content block events from streamed pieces: a block opens when a piece of a
    new kind arrives, closing the one before; text and thinking go as deltas, each tool call
    (whole, as the chat stream sends it) as one block with one input_json_delta."""

    _DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}

    def __init__(self) -> None:
        self.index = -1  # of the open block
        self.open: Optional[str] = None  # its kind

    def feed(self, kind: str, value: Any) -> list[str]:
        """The events that piece adds."""
        out = []
        if kind == "tool_use" or kind != self.open:
            out += self.close()
            self.index += 1
            self.open = kind
            start = (_tool_use_block(value, with_input=False) if kind == "tool_use"
                     else thinking_block("") if kind == "thinking"
                     else {"type": "text", "text": ""})
            out.append(event("content_block_start", {"type": "content_block_start",
                                                     "index": self.index, "content_block": start}))
        delta = ({"type": "input_json_delta", "partial_json": value["function"]["arguments"]}
                 if kind == "tool_use" else
                 {"type": self._DELTAS[kind][0], self._DELTAS[kind][1]: value})
        out.append(event("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.index, "delta": delta}))
        return out

    def close(self) -> list[str]:
        """The events closing the open block (none when none is open)."""
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # the SDK's thinking block carries a signature
            out.append(event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(event("content_block_stop", {"type": "content_block_stop",
                                                "index": self.index}))
        self.open = None
        return out


async def _events(run: ChatRun, choice) -> AsyncIterator[str]:
    """message_start, ping, the content blocks of each chat delta (choice: the chat path's
    splitter of the one choice) as it comes, message_delta
    (stop_reason, usage), message_stop; a failure mid-stream ends it with an error event."""
    head = {**_message_head(run), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(run.prompt_token_ids), "output_tokens": 0}}
    yield event("message_start", {"type": "message_start", "message": head})
    yield event("ping", {"type": "ping"})
    blocks, output_tokens = BlockStream(), 0
    stop: tuple[Optional[str], Optional[str]] = (None, None)
    try:
        async for out in run.gen:
            comp = out.outputs[0]
            output_tokens += len(comp.token_ids)
            for ch in choice.step(comp):
                for kind, value in blocks_of(ch["delta"]):
                    for line in blocks.feed(kind, value):
                        yield line
                if ch["finish_reason"] is not None:
                    stop = stop_of(ch["finish_reason"], comp)
    except Exception as err:  # the request or the engine failed mid-stream, or the drain
        yield event("error", anthropic_error_body(stream_error(err)))
        return
    for line in blocks.close():
        yield line
    yield event("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                  "usage": {"output_tokens": output_tokens}})
    yield event("message_stop", {"type": "message_stop"})
