"""The one chat path: messages (with tools and documents) through the model's chat template to
token ids, for LLM.chat, the chat endpoint, /tokenize and the in-process CLI alike."""
from __future__ import annotations

import json
from typing import Any, Optional


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *,
                chat_template: Optional[str] = None,
                tools: Optional[list[dict[str, Any]]] = None,
                documents: Optional[list[dict[str, Any]]] = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """Token ids of a conversation through chat_template (default: the model's); ValueError
    naming `messages` when there is no template or it fails on these messages."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages need a chat template and this model has none: pass "
                         "chat_template (the server's --chat-template FILE), or send a plain "
                         "prompt to the completions API")
    extra = {"tools": tools} if tools is not None else {}
    if documents is not None:
        extra["documents"] = documents
    try:
        ids = tokenizer.apply_chat_template(
            template_messages(messages), chat_template=template, tokenize=True,
            return_dict=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **extra,
            **(chat_template_kwargs or {}))
    except Exception as err:  # a template that raises on this conversation
        raise ValueError(f"messages could not be rendered by the chat template: {err}") from None
    # some transformers versions return a BatchEncoding
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool_calls with their arguments as objects, as chat templates expect (Qwen2.5's
    writes `arguments | tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # left as text: the template shows what the client sent
    return {**call, "function": fn}
