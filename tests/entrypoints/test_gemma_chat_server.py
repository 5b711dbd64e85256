"""`pagedllm serve` on the real Gemma 3 270M GGUF (no chat template in the file): chat answers
200 on the known Gemma template, logged at start, and <end_of_turn> ends the answer."""
from __future__ import annotations

import httpx
import pytest

from conftest import Server

GEMMA = "gemma-3-270m"
END_OF_TURN = 106


@pytest.fixture(scope="module")
def gemma_server(gemma_gguf):
    srv = Server("--max-model-len", "512", "--max-num-seqs", "2", model=GEMMA)
    yield srv
    srv.stop()


def _chat(server: Server, **extra) -> httpx.Response:
    body = {"model": GEMMA, "messages": [{"role": "user", "content": "What is the capital of "
                                                                    "France?"}],
            "temperature": 0, "max_tokens": 8, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_chat_answers_200_on_the_known_template(gemma_server):
    r = _chat(gemma_server, max_tokens=4)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["message"]["role"] == "assistant"
    log = gemma_server.log_tail(100_000)
    assert "using pagedllm's built-in Gemma template" in log and "--chat-template" in log


def test_end_of_turn_stops_the_answer(gemma_server):
    r = _chat(gemma_server, min_tokens=2, logit_bias={str(END_OF_TURN): 100})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    # two tokens of answer, then <end_of_turn>, which is not part of the text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert choice["message"]["content"] and "<end_of_turn>" not in choice["message"]["content"]
