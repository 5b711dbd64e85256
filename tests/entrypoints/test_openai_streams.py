"""Streams with several choices, and requests whose client goes away, on a real server."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import httpx
import pytest
from openai import OpenAI

from conftest import API_KEY, MODEL


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _check_each_choice_finishes_once(events: list[tuple[int, str, Optional[str]]],
                                     num_choices: int) -> None:
    """events: (index, text, finish_reason) per streamed choice, in order."""
    finished_at: dict[int, int] = {}
    for pos, (index, text, reason) in enumerate(events):
        assert index not in finished_at, \
            f"choice {index} sent {text!r} / {reason!r} after its finish chunk"
        if reason is not None:
            finished_at[index] = pos
    assert sorted(finished_at) == list(range(num_choices)), events
    # the case under test: a choice finished while another still had text to stream
    first = min(finished_at.values())
    later = [i for i, text, _ in events[first + 1:] if text]
    assert any(later.count(i) >= 2 for i in set(later)), events


def test_chat_stream_n3_sends_each_finish_once(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], n=3,
        max_tokens=60, temperature=1.0, seed=7, stop=["."], stream=True)
    events = [(c.index, c.delta.content or "", c.finish_reason)
              for chunk in stream for c in chunk.choices]
    _check_each_choice_finishes_once(events, 3)


def test_completion_stream_n3_sends_each_finish_once(client):
    stream = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "The sea is"], n=3, max_tokens=60,
        temperature=1.0, seed=7, stop=["."], stream=True)
    events = [(c.index, c.text, c.finish_reason) for chunk in stream for c in chunk.choices]
    _check_each_choice_finishes_once(events, 6)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["Tell me a long story.", "Count to a million."]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}],
                              "n": 2}),
])
def test_disconnect_without_stream_frees_blocks(server, path, body):
    body = {"model": MODEL, "max_tokens": 4000, "ignore_eos": True, **body}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post() -> None:
        # the read timeout closes the connection: the client is gone mid-generation
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}{path}", json=body, headers=headers,
                       timeout=httpx.Timeout(10, read=3))

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(post)
        deadline = time.monotonic() + 3
        while server.metrics()["vllm:num_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        m = server.metrics()
        assert m["vllm:num_requests_running"] == 2 and m["vllm:kv_cache_usage_perc"] > 0, m
        done.result()
    m = server.wait_idle()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, \
        (m, server.log_tail())
