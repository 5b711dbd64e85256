"""LLM.chat(tools=...) renders the tools, an assistant's tool_calls (arguments as JSON text, as
OpenAI sends them) and a tool result through the model's own template (Qwen2.5, hermes)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call-1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature_c": 18}'}]


@pytest.fixture(scope="module")
def llm(qwen_gguf):
    return LLM(model=str(qwen_gguf), max_model_len=1024, max_num_seqs=2)


def test_chat_renders_tools_calls_and_results(llm):
    (out,) = llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS)
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt  # the arguments as an object, not a JSON string inside JSON
    assert '<tool_response>\n{"temperature_c": 18}\n</tool_response>' in prompt
    (plain,) = llm.chat(CONVERSATION[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert "<tools>" not in llm.get_tokenizer().decode(plain.prompt_token_ids)
