"""The OpenAI-compatible server against the official openai client, on the real SmolLM2 weights."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, AuthenticationError, BadRequestError, NotFoundError, OpenAI

from conftest import API_KEY, MODEL


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    assert out.choices[0].text.startswith(" Paris")
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.choices[0].finish_reason == "length"


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt=["def add(a, b):", "Water boils at"], max_tokens=12,
              temperature=0)
    full = client.completions.create(**kw)
    texts = {}
    usage = None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(2)] == [c.text for c in full.choices]
    assert usage.completion_tokens == full.usage.completion_tokens == 24


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                          temperature=0, seed=1)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, seed=1, stream=True)
        if c.choices)
    assert streamed == full.choices[0].message.content and streamed.strip()
    assert full.choices[0].message.role == "assistant"
    lp = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    streamed_lp = [t for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed_lp] == \
        [(t.token, round(t.logprob, 4)) for t in content]
    comp = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0, logprobs=2)
    streamed = [lp for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
        logprobs=2, stream=True) for lp in (c.choices[0].logprobs.token_logprobs
                                            if c.choices and c.choices[0].logprobs else [])]
    assert [round(x, 4) for x in streamed] == \
        [round(x, 4) for x in comp.choices[0].logprobs.token_logprobs]


def test_sixteen_concurrent_streams_equal_sequential(server, client):
    prompts = [f"Write a short sentence about the number {i}." for i in range(16)]
    sequential = [client.completions.create(
        model=MODEL, prompt=p, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(aclient, p):
        text = ""
        async for chunk in await aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def all_at_once():
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                               max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(all_at_once()) == sequential


def test_disconnect_mid_stream_frees_blocks(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = []
        # keep the line iterator referenced: once it is garbage-collected (as a bare
        # `for line in resp.iter_lines()` is after the break), httpcore closes the connection,
        # which is a disconnect, and the server rightly aborts the request
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 3:
                break
        assert len(events) == 3 and "[DONE]" not in events[-1], events
        m = server.metrics()
        assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0, \
            (m, server.log_tail())
    m = server.wait_idle()  # the abort happens on the engine thread's next turn
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_metrics_page(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] >= 4


def test_bad_requests_get_openai_errors(server, client):
    with pytest.raises(NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(BadRequestError, match=r"prompt is \d+ tokens long but max_model_len is 8192"):
        client.completions.create(model=MODEL, prompt="hello " * 9000)
    with pytest.raises(BadRequestError, match="temperature must be >= 0") as err:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       top_p=7)
    with pytest.raises(BadRequestError, match="n must be <= 16"):
        client.completions.create(model=MODEL, prompt="x", n=100)
    with pytest.raises(BadRequestError, match="messages must not be empty"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(BadRequestError, match="role must be one of"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(BadRequestError, match="suffix is not supported"):
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_api_key_is_required(server):
    bad = OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/nonexistent")):
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/health", "/metrics", "/version", "/openapi.json"):  # probes and the docs
        assert httpx.get(f"{server.url}{path}").status_code == 200, path


def test_tokenize_detokenize_version(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(f"{server.url}/tokenize", headers=headers,
                     json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", headers=headers,
                      json={"tokens": ids}).json()["prompt"] == "Hello world"
    assert httpx.post(f"{server.url}/detokenize", headers=headers,
                      json={"tokens": [-1]}).status_code == 400
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_unknown_paths_and_methods_get_openai_errors(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, status in (("POST", "/v1/no-such-endpoint", 404), ("GET", "/v1/nonexistent", 404),
                                 ("GET", "/nonexistent", 404),
                                 ("GET", "/v1/chat/completions", 405)):
        r = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
        assert r.status_code == status, (method, path, r.text)
        error = r.json()["error"]
        assert error["code"] == status and error["param"] is None and path in error["message"]
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert "POST" in r.headers["allow"]


def test_body_validation_errors_name_the_field(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body, field in (("/v1/chat/completions", {"model": MODEL}, "messages"),
                              ("/v1/chat/completions", {"model": MODEL, "n": "abc", "messages": [
                                  {"role": "user", "content": "x"}]}, "n"),
                              ("/v1/completions", {"model": MODEL, "prompt": "x",
                                                   "max_tokens": "many"}, "max_tokens")):
        r = httpx.post(f"{server.url}{path}", json=body, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}: "), error
        assert error["type"] == "invalid_request_error" and error["code"] == 400
