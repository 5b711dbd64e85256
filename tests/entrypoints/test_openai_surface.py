"""The rest of the OpenAI/vLLM surface on the completions endpoint: lm-eval's log-likelihood
request (echo + logprobs, max_tokens 0 and 1) checked against the offline engine, vLLM's
response extras, and fields that are refused or ignored."""
from __future__ import annotations

import math

import httpx
import pytest
from openai import BadRequestError, OpenAI

from conftest import API_KEY, MODEL
from pagedllm import LLM, SamplingParams

CONTEXT, CONTINUATION = "The capital of France is", " Paris, a city on the Seine."


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(smollm_gguf):
    # the server's settings: float32, dequantized (conftest's server fixture)
    return LLM(model=str(smollm_gguf), quantization="none", dtype="float32", max_model_len=512)


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_request_matches_offline_prompt_logprobs(client, offline, max_tokens):
    text = CONTEXT + CONTINUATION
    out = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1,
                                    max_tokens=max_tokens, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    ids = offline.get_tokenizer().encode(text)
    assert choice.text.startswith(text) and len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert out.usage.completion_tokens == max_tokens and out.usage.prompt_tokens == len(ids)
    if max_tokens == 0:
        assert choice.text == text and choice.finish_reason == "length"
    # lm-eval sums the continuation's token logprobs
    n_ctx = len(offline.get_tokenizer().encode(CONTEXT))
    served = sum(lp.token_logprobs[n_ctx:len(ids)])
    ref = offline.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0].prompt_logprobs
    expected = sum(ref[i][ids[i]].logprob for i in range(n_ctx, len(ids)))
    assert math.isclose(served, expected, abs_tol=1e-3), (served, expected)


def test_max_tokens_zero_needs_echo(client):
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_echo_streamed_with_logprobs(client):
    stream = client.completions.create(model=MODEL, prompt=CONTEXT, echo=True, logprobs=1,
                                       max_tokens=3, temperature=0, stream=True,
                                       stream_options={"include_usage": True,
                                                       "continuous_usage_stats": True})
    chunks = list(stream)
    texted = [c for c in chunks if c.choices]
    assert texted[0].choices[0].text.startswith(CONTEXT)
    assert texted[0].choices[0].logprobs.token_logprobs[0] is None
    assert all(c.usage is not None for c in chunks)  # usage in every chunk
    tokens = sum(len(c.choices[0].logprobs.tokens) for c in texted)
    assert tokens == chunks[-1].usage.prompt_tokens + 3


def test_token_ids_prompt_logprobs_and_token_strs(client, server):
    r = httpx.post(f"{server.url}/v1/completions", headers=_headers(), json={
        "model": MODEL, "prompt": CONTEXT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["prompt_token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(choice["prompt_token_ids"])
    assert str(choice["prompt_token_ids"][1]) in plp[1]
    t = httpx.post(f"{server.url}/tokenize", headers=_headers(),
                   json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert len(t["token_strs"]) == t["count"] and "".join(t["token_strs"]).endswith("world")


@pytest.mark.parametrize("field,value", [
    ("use_beam_search", True), ("length_penalty", 0.5), ("bad_words", ["x"]),
    ("functions", [{"name": "f"}]), ("prompt_embeds", "abc"), ("store", True),
    ("priority", 3), ("logits_processors", ["x"]),
])
def test_defined_but_unimplemented_fields_are_refused(server, field, value):
    r = httpx.post(f"{server.url}/v1/completions", headers=_headers(),
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_neutral_values_and_unknown_fields_are_accepted(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=_headers(), json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "use_beam_search": False,
        "length_penalty": 1.0, "user": "me", "a_field_of_no_api": 1})
    assert r.status_code == 200, r.text
    assert "ignoring request fields outside the OpenAI and vLLM APIs: a_field_of_no_api" in \
        server.log_tail()


def test_chat_prompt_logprobs_token_ids_and_continuous_usage(client, server):
    messages = [{"role": "user", "content": "Say hi."}]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=_headers(), json={
        "model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
        "prompt_logprobs": 0, "return_token_ids": True})
    body = r.json()
    assert r.status_code == 200, r.text
    assert len(body["prompt_logprobs"]) == len(body["prompt_token_ids"]) == \
        body["usage"]["prompt_tokens"]
    assert body["prompt_logprobs"][0] is None
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert chunks and all(c.usage is not None for c in chunks)


@pytest.mark.parametrize("tools", [False, True])
def test_chat_stream_return_token_ids(client, server, tools):
    """Streamed chat with return_token_ids: prompt_token_ids on the first chunk, each chunk's
    token_ids, which add up to the non-streamed response's (tools: the tool-call stream)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": "greet", "parameters": {"type": "object", "properties": {}}}}]
        body["tool_choice"] = "required"
    whole = httpx.post(f"{server.url}/v1/chat/completions", headers=_headers(), json=body).json()
    stream = client.chat.completions.create(stream=True, **{
        k: v for k, v in body.items() if k not in ("return_token_ids",)},
        extra_body={"return_token_ids": True})
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == whole["choices"][0]["token_ids"] and streamed
