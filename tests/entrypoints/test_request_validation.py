"""Every request field the engine could choke on is a 400 naming it, and the engine goes on;
a fault in the shared step makes `pagedllm serve` exit non-zero so a supervisor restarts it."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from conftest import API_KEY, MODEL, _free_port

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, headers=HEADERS,
                      timeout=60)


@pytest.mark.parametrize("path, body, param, message", [
    ("completions", {"prompt": "Hi", "seed": 2**64}, "seed", "9223372036854775807"),
    ("completions", {"prompt": "Hi", "seed": -(2**63) - 1}, "seed", "-9223372036854775808"),
    ("completions", {"prompt": "Hi", "seed": 2**64 - 1, "n": 2}, "seed", "9223372036854775807"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "seed": 2**64},
     "seed", "9223372036854775807"),
    ("completions", {"prompt": "Hi", "max_tokens": 10**12}, "max_tokens",
     "max_tokens (or max_completion_tokens) is too large: 1000000000000. This model's maximum "
     "context length is"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                          "max_completion_tokens": 10**12}, "max_tokens", "is too large"),
    ("completions", {"prompt": "\x04\x06\x13\x14\x16\x1d"}, "prompt",
     "prompt tokenizes to no tokens"),
    ("completions", {"prompt": "Hi", "n": 1, "best_of": 3}, "best_of",
     "best_of must be None or equal to n=1"),
    ("completions", {"prompt": [[1, 2, 10**9]]}, "prompt_token_ids", "prompt_token_ids must be"),
])
def test_bad_fields_are_400_and_the_engine_goes_on(server, path, body, param, message):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param and err["code"] == 400
    assert err["message"].startswith(param)
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = _post(server, "completions", {"prompt": "Hello", "max_tokens": 2, "seed": 2**63 - 1,
                                       "n": 2, "temperature": 1.0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


_CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("path, body, param, message", [
    ("/detokenize", {"tokens": [True]}, "tokens.0", "must be an integer, not true"),
    ("/detokenize", {"tokens": [5, False]}, "tokens.1", "must be an integer, not false"),
    ("/v1/completions", {"prompt": [True]}, "prompt", "prompt[0] is a boolean"),
    ("/v1/completions", {"prompt": [[1, 2], [3, False]]}, "prompt", "prompt[1][1] is a boolean"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [True]}, "stop_token_ids.0",
     "must be an integer"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [False, 5]},
     "allowed_token_ids.0", "must be an integer"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": True}}, "logit_bias.5",
     "must be a number, not true"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens", "must be an integer"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs", "must be an integer"),
    ("/v1/chat/completions", {**_CHAT, "n": True}, "n", "must be an integer"),
    ("/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": True},
     "top_logprobs", "must be an integer"),
])
def test_booleans_are_not_integers(server, path, body, param, message):
    """JSON's true is no token id or count (pydantic's lax mode read it as 1)."""
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers=HEADERS,
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


_FAULTY_SERVE = """
import sys
from pagedllm.engine.engine_core import EngineCore

def step(self):  # a fault in the shared step (the forward, the KV cache)
    raise RuntimeError("injected fault in the forward")

EngineCore.step = step
from pagedllm.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_exits_nonzero_when_the_engine_stops(tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", _FAULTY_SERVE, "serve", MODEL, "--port",
                                 str(port), "--dtype", "float32", "--max-model-len", "256"],
                                stdout=fh, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        assert "injected fault in the forward" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
        assert "the engine stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
