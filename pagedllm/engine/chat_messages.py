"""Chat messages as chat templates expect them, shared by LLM.chat and the chat endpoint."""
from __future__ import annotations

import json
from typing import Any


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
