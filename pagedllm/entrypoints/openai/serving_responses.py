"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's
Responses API over the one chat path (serving_chat.start_chat: templating, tools, constraints)
and its choice splitter (reasoning, answer, tool calls), streamed as typed events:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.reasoning_text.delta ... .done
      message:   response.content_part.added, response.output_text.delta ... .done,
                 response.content_part.done
      call:      response.function_call_arguments.delta, .done
    response.output_item.done, ..., response.completed | .incomplete | .failed
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional

from pagedllm.entrypoints.openai.response_store import Running
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, input_messages
from pagedllm.entrypoints.openai.serving_chat import ChatRun, chat_message, chat_usage, start_chat
from pagedllm.entrypoints.openai.serving_common import (OpenAIError, ServerContext, new_id, now,
                                                        stream_error)
from pagedllm.outputs import RequestOutput

# the chat path's field names -> the Responses API's, for the 400s it raises
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "response_format.json_schema.schema": "text.format.schema"}


def _history(ctx: ServerContext, previous: Optional[str]) -> list[dict[str, Any]]:
    if previous is None:
        return []
    stored = ctx.responses.get(previous)
    if stored is None:
        raise OpenAIError(f"previous_response_id {previous!r}: no stored response has this id "
                          "(never stored, or evicted from the bounded store)", 404,
                          "previous_response_id")
    return stored.messages


def _skeleton(rid: str, model: str, req: ResponsesRequest) -> dict[str, Any]:
    """The response object before any output: the request's settings, in_progress."""
    return {"id": rid, "object": "response", "created_at": now(), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "truncation": "disabled", "metadata": req.metadata or {},
            "usage": None}


async def create_response(ctx: ServerContext, req: ResponsesRequest,
                          client: Optional[str] = None):
    """The response object, or an async iterator of its events when req.stream."""
    req.check_fields()  # before the renaming below: these already speak the Responses API
    history = _history(ctx, req.previous_response_id)
    try:
        chat = req.chat_request(history)
        run = await start_chat(ctx, chat, client, prefix="resp")
    except OpenAIError as err:
        raise err.renamed(_PARAMS) from None
    conversation = history + input_messages(req.input)
    body = _skeleton(run.request_id, run.model, req)
    running = Running(body)
    ctx.responses.running[run.request_id] = running
    if req.stream:
        return _events(ctx, req, chat, run, running, conversation)
    try:
        final = None
        async for final in _outputs(run.gen, running.cancelled):
            pass
    finally:
        ctx.responses.running.pop(run.request_id, None)
    return _finish(ctx, req, run, body, final, running.cancelled.is_set(), conversation)


def _finish(ctx: ServerContext, req: ResponsesRequest, run: ChatRun, body: dict[str, Any],
            final: Optional[RequestOutput], cancelled: bool,
            conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole response object of a finished (or cancelled) run, stored if asked."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    finish = None
    if final is not None:
        message, finish = chat_message(run.plan, run.reasoning, final.outputs[0])
        body["usage"] = _usage(chat_usage(final, run.reasoning))
    body["output"] = output_items(message)
    _set_status(body, finish, cancelled, final.error if final else None)
    if req.store and not cancelled:
        ctx.responses.put(body, conversation + [_assistant(message)])
    return body


def _set_status(body: dict[str, Any], finish: Optional[str], cancelled: bool,
                error: Optional[str] = None) -> None:
    if cancelled:
        body["status"] = "cancelled"
    elif finish == "length":
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    elif finish == "error":
        body["status"] = "failed"
        body["error"] = {"code": "server_error", "message": error or "the request failed"}
    else:
        body["status"] = "completed"


def _assistant(message: dict[str, Any]) -> dict[str, Any]:
    """The chat message a continuation's template renders for this output."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    for key in ("tool_calls", "reasoning"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    details = chat.get("completion_tokens_details") or {}
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" else []}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (serving_chat.chat_message) as Responses output items: its reasoning,
    its answer (when it has one, or nothing else), its function calls."""
    items = []
    if message.get("reasoning") is not None:
        items.append(_reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        items.append(_message_item(message.get("content") or ""))
    items.extend(_call_item(c) for c in calls)
    return items


async def _next(it: AsyncIterator[RequestOutput]) -> Optional[RequestOutput]:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def _outputs(gen: AsyncIterator[RequestOutput],
                   cancelled: asyncio.Event) -> AsyncIterator[RequestOutput]:
    """gen's outputs until it ends or cancel is set (then gen is closed: the request is
    aborted and its KV blocks freed)."""
    stop = asyncio.ensure_future(cancelled.wait())
    try:
        while True:
            step = asyncio.ensure_future(_next(gen))
            await asyncio.wait((step, stop), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                return
            out = step.result()
            if out is None:
                return
            yield out
    finally:
        stop.cancel()
        close = getattr(gen, "aclose", None)
        if close is not None:
            await close()


class _EventWriter:
    """The typed events of one streamed response: sequence numbers, and the one output item
    open at a time (reasoning or message) closed when another kind begins."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.seq = body, 0
        self.open: Optional[dict[str, Any]] = None
        self.text = ""

    def event(self, kind: str, **data: Any) -> str:
        """One server-sent event of the given type."""
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.body["output"]) - 1}

    def delta(self, kind: str, text: str) -> list[str]:
        """Events for new reasoning (kind "reasoning") or answer (kind "message") text."""
        out = [] if self.open is not None and self.open["type"] == kind else self.close()
        if self.open is None:
            self.open = _reasoning_item("", "in_progress") if kind == "reasoning" else \
                _message_item("", "in_progress")
            if kind == "reasoning":
                self.open["content"] = []
            self.body["output"].append(self.open)
            out.append(self.event("response.output_item.added", output_index=len(
                self.body["output"]) - 1, item=self.open))
            if kind == "message":
                out.append(self.event("response.content_part.added", **self._where(),
                                      content_index=0, part=_part("")))
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, **self._where(), content_index=0, delta=text, **extra))
        return out

    def close(self) -> list[str]:
        """Events that end the open item, if any."""
        if self.open is None:
            return []
        item, text, where = self.open, self.text, self._where()
        if item["type"] == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, content_index=0,
                              text=text)]
            item["content"] = [{"type": "reasoning_text", "text": text}]
        else:
            out = [self.event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0,
                              part=_part(text))]
            item["content"] = [_part(text)]
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=item))
        self.open, self.text = None, ""
        return out

    def call(self, call: dict[str, Any]) -> list[str]:
        """Events of one whole function call."""
        out = self.close()
        item = _call_item(call)
        self.body["output"].append(item)
        index = len(self.body["output"]) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"}))
        out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"]))
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _events(ctx: ServerContext, req: ResponsesRequest, chat: Any, run: ChatRun,
                  running: Running, conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
    """The stream: each output's choice deltas (the chat path's splitter) as typed events."""
    body = running.body
    writer = _EventWriter(body)
    choice = run.choice_stream(ctx, chat)
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    finish, tokens, error = None, 0, None
    yield writer.event("response.created", response=body)
    yield writer.event("response.in_progress", response=body)
    outputs = _outputs(run.gen, running.cancelled)
    try:
        async for out in outputs:
            comp = out.outputs[0]
            tokens += len(comp.token_ids)
            error = out.error or error
            for ch in choice.step(comp):
                delta, finish = ch["delta"], ch["finish_reason"] or finish
                if delta.get("reasoning"):
                    message["reasoning"] = message.get("reasoning", "") + delta["reasoning"]
                    for line in writer.delta("reasoning", delta["reasoning"]):
                        yield line
                if delta.get("content"):
                    message["content"] += delta["content"]
                    for line in writer.delta("message", delta["content"]):
                        yield line
                for call in delta.get("tool_calls") or []:
                    message.setdefault("tool_calls", []).append(
                        {k: call[k] for k in ("id", "type", "function")})
                    for line in writer.call(call):
                        yield line
    except Exception as err:  # the request or the engine failed mid-stream
        finish, error = "error", stream_error(err).message
    finally:  # also when the client went away: the request is aborted at once
        ctx.responses.running.pop(run.request_id, None)
        await outputs.aclose()
    for line in writer.close():
        yield line
    cancelled = running.cancelled.is_set()
    reasoning = choice.reasoning_tokens if run.reasoning is not None else None
    body["usage"] = _usage({"prompt_tokens": len(run.prompt_token_ids),
                            "completion_tokens": tokens, "total_tokens":
                            len(run.prompt_token_ids) + tokens,
                            "completion_tokens_details": {"reasoning_tokens": reasoning or 0}})
    _set_status(body, "tool_calls" if message.get("tool_calls") else finish, cancelled, error)
    if req.store and not cancelled:
        ctx.responses.put(body, conversation + [_assistant(message)])
    kind = {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed",
            # the API streams no event of its own for a cancel: the stream ends incomplete
            "cancelled": "response.incomplete"}[body["status"]]
    yield writer.event(kind, response=body)


def get_response(ctx: ServerContext, rid: str) -> dict[str, Any]:
    """GET /v1/responses/{id}: a stored or running response; 404 naming response_id."""
    running = ctx.responses.running.get(rid)
    if running is not None:
        return running.body
    stored = ctx.responses.get(rid)
    if stored is None:
        raise OpenAIError(f"response {rid!r} not found (never stored, or evicted from the "
                          "bounded store)", 404, "response_id")
    return stored.body


def cancel_response(ctx: ServerContext, rid: str) -> dict[str, Any]:
    """POST /v1/responses/{id}/cancel: stop a running response (its status becomes
    cancelled); a finished one is a 400, an unknown one a 404, both naming response_id."""
    running = ctx.responses.running.get(rid)
    if running is None:
        if ctx.responses.get(rid) is not None:
            raise OpenAIError(f"response {rid!r} has finished: only a response in progress "
                              "can be cancelled", 400, "response_id")
        raise OpenAIError(f"response {rid!r} not found", 404, "response_id")
    running.cancelled.set()
    running.body["status"] = "cancelled"
    return running.body
