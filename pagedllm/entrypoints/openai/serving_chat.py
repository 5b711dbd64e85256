"""POST /v1/chat/completions: the model's chat template, then generation, streaming or not."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from pagedllm.tokenizer.chat_messages import template_messages
from pagedllm.entrypoints.openai.chat_tools import PassThrough, ToolPlan, plan_tools
from pagedllm.entrypoints.openai.reasoning_parsers import (ReasoningDelta, ReasoningParser,
                                                           reasoning_fields)
from pagedllm.entrypoints.openai.tool_parsers import StreamDelta
from pagedllm.entrypoints.openai.protocol import ROLES, ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_common import (SSE_DONE, OpenAIError, ServerContext,
                                                        bad_request, check_n, compile_grammar,
                                                        new_id, now,
                                                        prompt_logprobs_json, sse,
                                                        start_prompts, stream_error, usage)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as template input: known roles, text content (string or text parts), an
    assistant's tool_calls and a tool message's tool_call_id."""
    if not messages:
        raise OpenAIError("messages must not be empty", 400, "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise OpenAIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                              f"{m.role!r}", 400, f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(f"messages[{i}].content[{j}] must be a text part "
                                      "({'type': 'text', 'text': ...}); other parts are not "
                                      "supported", 400, f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        thought = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thought is not None:
            msg["reasoning_content"] = thought
        out.append(msg)
    return template_messages(out)


def chat_prompt_ids(ctx: ServerContext, req: ChatCompletionRequest,
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Token ids of the templated conversation (with the tools the template renders). A user or
    system message too long to fit max_model_len is refused before the template renders it
    (chat templates write those messages out whole)."""
    messages = conversation(req.messages)
    try:
        for i, m in enumerate(messages):
            if m["role"] in ("user", "system"):
                ctx.tokens.check_text(m["content"], f"messages[{i}].content")
        return ctx.engine.chat_prompt_ids(
            messages, chat_template=ctx.chat_template, tools=tools,
            documents=req.documents, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs)
    except ValueError as err:
        raise bad_request(err) from None


def _params(ctx: ServerContext, req: ChatCompletionRequest,
            plan: Optional[ToolPlan]) -> SamplingParams:
    check_n(req.n, req.best_of)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)  # None: until max_model_len
    try:
        return req.sampling_params(max_tokens, ctx.engine.default_sampling_params(),
                                   logprobs, plan.constraint if plan else None)
    except ValueError as err:
        raise bad_request(err) from None


def _token_info(tokenizer, tok: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([tok])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _logprobs(tokenizer, comp: CompletionOutput, k: int) -> Optional[dict[str, Any]]:
    """OpenAI's chat logprobs for comp's tokens."""
    if comp.logprobs is None:
        return None
    content = []
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        entry = _token_info(tokenizer, tok, lp[tok].logprob)
        ranked = sorted(lp.items(), key=lambda kv: kv[1].rank or 0)[:k]
        entry["top_logprobs"] = [_token_info(tokenizer, t, v.logprob) for t, v in ranked]
        content.append(entry)
    return {"content": content}


def _plan(ctx: ServerContext, req: ChatCompletionRequest) -> Optional[ToolPlan]:
    return plan_tools(req, ctx.tool_parser, ctx.enable_auto_tool_choice,
                      ctx.exclude_tools_when_tool_choice_none)


def chat_message(plan: Optional[ToolPlan], reasoning: Optional[ReasoningParser],
                 comp: CompletionOutput, include_reasoning: bool = True
                 ) -> tuple[dict[str, Any], str]:
    """A whole choice's message and finish_reason ("tool_calls" when it made calls): the
    reasoning split off first (under `reasoning` and `reasoning_content`), then the tool calls
    parsed from the answer alone. Every API over the chat path builds its result from this."""
    thought, text = (None, comp.text) if reasoning is None else reasoning.split(comp.text)
    finish = comp.finish_reason
    if plan is None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
    else:
        content, calls = plan.extract(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
            finish = "tool_calls"
    if include_reasoning:
        message.update(reasoning_fields(thought))
    return message, finish


def request_reasoning(ctx: ServerContext, ids: list[int]) -> Optional[ReasoningParser]:
    """The request's reasoning split (None without a parser): where its prompt leaves it."""
    if ctx.reasoning is None:
        return None
    return ReasoningParser(ctx.reasoning, ctx.engine.tokenizer, ids)


@dataclass
class ChatRun:
    """A chat request started on the engine: what its answer is built from."""

    model: str  # the served name it asked for
    request_id: str
    prompt_token_ids: list[int]
    plan: Optional[ToolPlan]
    reasoning: Optional[ReasoningParser]
    gen: AsyncIterator[RequestOutput]

    def choice_stream(self, ctx: ServerContext, req: ChatCompletionRequest) -> "_ChoiceStream":
        """A fresh splitter (reasoning, answer, tool calls) of one streamed choice."""
        tools = self.plan if self.plan is not None and self.plan.choice != "none" else None
        return _ChoiceStream(ctx.engine.tokenizer, req, tools, self.reasoning)


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, client: Optional[str] = None,
                     prefix: str = "chatcmpl") -> ChatRun:
    """The one chat input path: tools planned, sampling checked, the conversation templated
    and tokenized, the constraint compiled, the request queued (400s name the field)."""
    model = ctx.check_model(req.model)
    plan = _plan(ctx, req)
    params = _params(ctx, req, plan)
    # the template and the tokenizing on the tokenizer's thread: the event loop stays free
    ids = await ctx.tokens.run(chat_prompt_ids, ctx, req, plan.tools if plan else None)
    grammar = await compile_grammar(ctx.engine, params)
    rid = new_id(prefix)
    (gen,) = await start_prompts(ctx, [{"prompt_token_ids": ids}], params, rid, client, grammar,
                                 ctx.lora_for(model))
    return ChatRun(model, rid, ids, plan, request_reasoning(ctx, ids), gen)


async def count_chat_tokens(ctx: ServerContext, req: ChatCompletionRequest) -> int:
    """How many tokens the request's templated prompt is (tools included), as start_chat
    would queue it; nothing is queued."""
    ctx.check_model(req.model)
    plan = _plan(ctx, req)
    ids = await ctx.tokens.run(chat_prompt_ids, ctx, req, plan.tools if plan else None)
    return len(ids)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest,
                                 client: Optional[str] = None):
    """The JSON response, or an async iterator of SSE lines when req.stream; client: who sent
    it, for --max-client-share."""
    run = await start_chat(ctx, req, client)
    model, rid, ids, plan, reasoning, gen = (run.model, run.request_id, run.prompt_token_ids,
                                             run.plan, run.reasoning, run.gen)
    if req.stream:
        head = _head(rid, model)
        if (plan is not None and plan.choice != "none") or reasoning is not None:
            return _stream_split(ctx, req, head, run)
        return _stream(ctx, req, head, gen, ids)
    final: Optional[RequestOutput] = None
    async for final in gen:
        pass
    tok = ctx.engine.tokenizer
    choices = []
    for c in final.outputs:
        message, finish = chat_message(plan, reasoning, c, req.include_reasoning)
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs(tok, c, req.top_logprobs or 0),
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    body = {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": chat_usage(final, reasoning)}
    return _extras(req, final, body)


def chat_usage(out: RequestOutput, reasoning: Optional[ReasoningParser] = None
               ) -> dict[str, Any]:
    """The usage object of one chat request's whole output (all its choices), with
    completion_tokens_details.reasoning_tokens when a reasoning parser is on."""
    thinking = None if reasoning is None else sum(reasoning.count(c.token_ids)
                                                  for c in out.outputs)
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                 thinking)


def _extras(req: ChatCompletionRequest, final: RequestOutput,
            body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's optional fields of a chat response: prompt_logprobs, prompt_token_ids, token_ids."""
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(final)
    if req.return_token_ids:
        body["prompt_token_ids"] = list(final.prompt_token_ids)
        for choice, comp in zip(body["choices"], final.outputs):
            choice["token_ids"] = list(comp.token_ids)
    return body


async def _framed(req: ChatCompletionRequest, head: dict[str, Any],
                  gen: AsyncIterator[RequestOutput],
                  choices_of: Callable[[RequestOutput], list[dict[str, Any]]],
                  prompt_token_ids: list[int],
                  reasoning_tokens: Optional[Callable[[], int]] = None) -> AsyncIterator[str]:
    """A chat stream's frame: each choice's role chunk (the first with prompt_token_ids when
    return_token_ids), then one chunk per choice delta that choices_of makes of each output
    (a RequestOutputKind.DELTA output: only what is new), with usage when
    continuous_usage_stats, errors as error events, the final usage chunk if asked for, and
    [DONE]. reasoning_tokens: how many of the tokens so far are reasoning (with a parser)."""
    opts = req.stream_options
    completion_tokens = 0

    def usage_so_far() -> dict[str, Any]:
        return usage(len(prompt_token_ids), completion_tokens,
                     None if reasoning_tokens is None else reasoning_tokens())

    try:
        for i in range(req.n):
            chunk = {**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                 "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if req.return_token_ids and i == 0:
                chunk["prompt_token_ids"] = list(prompt_token_ids)
            yield sse(chunk)
        async for delta in gen:
            completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
            for choice in choices_of(delta):
                chunk = {**head, "choices": [choice]}
                if opts and opts.continuous_usage_stats:
                    chunk["usage"] = usage_so_far()
                yield sse(chunk)
    except OpenAIError as err:
        yield sse(err.body())
    except Exception as err:  # the request or the engine failed mid-stream, or the drain
        yield sse(stream_error(err).body())
    else:
        if opts and opts.include_usage:
            yield sse({**head, "choices": [], "usage": usage_so_far()})
    yield SSE_DONE


def _head(rid: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}


def _stream(ctx: ServerContext, req: ChatCompletionRequest, head: dict[str, Any],
            gen: AsyncIterator[RequestOutput], prompt_token_ids: list[int]) -> AsyncIterator[str]:
    """A plain text stream: each choice's new text (and logprobs) as it comes."""
    tok = ctx.engine.tokenizer

    def choices_of(delta: RequestOutput) -> list[dict[str, Any]]:
        out = []
        for comp in delta.outputs:
            choice = {"index": comp.index, "delta": {"content": comp.text},
                      "logprobs": _logprobs(tok, comp, req.top_logprobs or 0),
                      "finish_reason": comp.finish_reason}
            if req.return_token_ids:
                choice["token_ids"] = list(comp.token_ids)
            out.append(choice)
        return out

    return _framed(req, head, gen, choices_of, prompt_token_ids)


class _ChoiceStream:
    """One streamed choice split by a reasoning parser and/or a tool parser: reasoning ->
    delta.reasoning (and reasoning_content), answer text -> content deltas, each completed call
    -> one delta.tool_calls, then its one finish; token logprobs ride on the next delta sent."""

    def __init__(self, tokenizer, req: ChatCompletionRequest, plan: Optional[ToolPlan],
                 reasoning: Optional[ReasoningParser]) -> None:
        self.tokenizer, self.req = tokenizer, req
        self.parser = plan.streamer() if plan is not None else PassThrough()
        self.thinking = reasoning.streamer() if reasoning is not None else None
        self.tracker = reasoning.tracker() if reasoning is not None else None
        self.reasoning_tokens = 0
        self.calls = 0
        self.logprobs: Optional[list[dict[str, Any]]] = None  # not yet sent
        self.token_ids: list[int] = []  # not yet sent (return_token_ids)

    def _split(self, comp: CompletionOutput) -> tuple[str, StreamDelta]:
        """(reasoning text, the answer's content and calls) this delta output adds."""
        if self.tracker is not None:
            self.reasoning_tokens += self.tracker.count(comp.token_ids)
        split = ReasoningDelta(content=comp.text)
        if self.thinking is not None:
            split = self.thinking.feed(comp.text) if comp.text else ReasoningDelta()
            if comp.finish_reason is not None:
                split = split + self.thinking.finish()
        delta = self.parser.feed(split.content) if split.content else StreamDelta()
        if comp.finish_reason is not None:
            last = self.parser.finish()
            delta = StreamDelta(delta.content + last.content, delta.calls + last.calls)
        return split.reasoning, delta

    def step(self, comp: CompletionOutput) -> list[dict[str, Any]]:
        """The choice objects of the chunks this delta output adds."""
        thought, delta = self._split(comp)
        lp = _logprobs(self.tokenizer, comp, self.req.top_logprobs or 0)
        self.token_ids += comp.token_ids
        if lp is not None:
            self.logprobs = (self.logprobs or []) + lp["content"]
        deltas: list[dict[str, Any]] = []
        if thought and self.req.include_reasoning:
            deltas.append(reasoning_fields(thought))
        if delta.content:
            deltas.append({"content": delta.content})
        for call in delta.calls:
            deltas.append({"tool_calls": [{"index": self.calls, **call.to_dict()}]})
            self.calls += 1
        out = [{"index": comp.index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in deltas]
        if comp.finish_reason is not None:
            out.append({"index": comp.index, "delta": {}, "logprobs": None,
                        "finish_reason": "tool_calls" if self.calls else comp.finish_reason})
        if out and self.logprobs is not None:
            out[0]["logprobs"], self.logprobs = {"content": self.logprobs}, None
        if out and self.req.return_token_ids:
            out[0]["token_ids"], self.token_ids = self.token_ids, []
        return out


def _stream_split(ctx: ServerContext, req: ChatCompletionRequest, head: dict[str, Any],
                  run: ChatRun) -> AsyncIterator[str]:
    """A stream with tools (auto, required or named) or a reasoning parser: _ChoiceStream."""
    choices = {i: run.choice_stream(ctx, req) for i in range(req.n)}

    def choices_of(delta: RequestOutput) -> list[dict[str, Any]]:
        return [c for comp in delta.outputs for c in choices[comp.index].step(comp)]

    def reasoning_tokens() -> int:
        return sum(c.reasoning_tokens for c in choices.values())

    return _framed(req, head, run.gen, choices_of, run.prompt_token_ids,
                   reasoning_tokens if run.reasoning is not None else None)
