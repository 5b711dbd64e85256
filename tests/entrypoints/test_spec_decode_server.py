"""Speculative decoding behind the server: --speculative-config, OpenAI's `prediction` (checked
naming its field), vLLM's spec_decode metrics and the SpecDecoding log line."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import Server
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4})


@pytest.fixture(scope="module")
def spec_server(smollm_gguf):
    srv = Server("--speculative-config", NGRAM, "--max-num-seqs", "4")
    yield srv
    srv.stop()


def _chat(content, **extra):
    return {"model": "smollm2-135m-instruct", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize("prediction, words", [
    ("text", ["prediction must be an object"]),
    ({"type": "text", "content": "x"}, ["prediction.type", "'content'"]),
    ({"type": "content"}, ["prediction.content"]),
    ({"type": "content", "content": [{"type": "image", "url": "x"}]}, ["prediction.content"]),
    ({"type": "content", "content": "x", "extra": 1}, ["prediction", "extra"]),
])
def test_prediction_is_checked_naming_the_field(prediction, words):
    body = ChatCompletionRequest.model_validate(_chat("hi", prediction=prediction))
    from pagedllm.sampling_params import SamplingParams
    with pytest.raises(ValueError) as err:
        body.sampling_params(10, SamplingParams(), None)
    for word in words:
        assert word in str(err.value)


def test_prediction_parts_are_joined():
    from pagedllm.entrypoints.openai.protocol import prediction_text
    parts = [{"type": "text", "text": "a b"}, {"type": "text", "text": " c"}]
    assert prediction_text({"type": "content", "content": parts}) == "a b c"


def test_prediction_without_speculation_is_refused(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(
        "hi", prediction={"type": "content", "content": "hello"}),
        headers={"Authorization": "Bearer test-key-123"}, timeout=60)
    assert r.status_code == 400 and "speculative" in r.text and "prediction" in r.text


def test_prediction_is_drafted_and_counted(spec_server):
    url = f"{spec_server.url}/v1/chat/completions"
    plain = httpx.post(url, json=_chat("Name three colours."), timeout=120).json()
    text = plain["choices"][0]["message"]["content"]
    before = spec_server.metrics()
    again = httpx.post(url, json=_chat("Name three colours.", prediction={
        "type": "content", "content": text}), timeout=120).json()
    assert again["choices"][0]["message"]["content"] == text
    after = spec_server.metrics()
    drafts = after["vllm:spec_decode_num_drafts_total"] - before.get(
        "vllm:spec_decode_num_drafts_total", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0)
    assert drafts > 0 and accepted > 0
    # the per-position series sum to the accepted tokens
    assert after["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == \
        after["vllm:spec_decode_num_accepted_tokens_total"]
    assert after["vllm:spec_decode_num_draft_tokens_total"] >= \
        after["vllm:spec_decode_num_accepted_tokens_total"]


def test_log_line_has_the_acceptance():
    from pagedllm.core.spec_decode import SpecStats
    from pagedllm.engine.async_engine import EngineStats
    from pagedllm.entrypoints.openai.request_log import RequestLog

    log = RequestLog(log_requests=False)
    log.stats_line(EngineStats(0, 0, 0.0, spec=SpecStats(2, 8, 6, [2, 2, 1, 1])))
    log.next_tokens(10, 0.1)
    line = log.stats_line(EngineStats(1, 0, 0.1, spec=SpecStats(4, 16, 8, [3, 3, 1, 1])))
    throughput, spec = line.splitlines()
    assert throughput.startswith("Avg prompt throughput")
    # since the last line: 2 drafts, 8 draft tokens, 2 accepted
    assert "Mean acceptance length: 2.00" in spec and "Accepted: 2 tokens" in spec
    assert "Drafted: 8 tokens" in spec and "Avg Draft acceptance rate: 25.0%" in spec
    assert "Per-position acceptance rate: 0.500, 0.500, 0.000, 0.000" in spec


def test_a_draft_model_behind_the_server(spec_server, smollm_hf_dir):
    """serve --speculative-config with a draft model (the float checkpoint, int4 at load):
    the answer is the plain server's, and the drafts are counted."""
    draft = json.dumps({"model": str(smollm_hf_dir), "quantization": "int4",
                        "num_speculative_tokens": 3, "min_acceptance_rate": 0})
    srv = Server("--speculative-config", draft, "--max-num-seqs", "2", "--max-model-len", "1024")
    try:
        body = _chat("Write a haiku about the sea.")
        plain = httpx.post(f"{spec_server.url}/v1/chat/completions", json=body,
                           timeout=120).json()
        got = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120).json()
        assert got["choices"][0]["message"]["content"] == \
            plain["choices"][0]["message"]["content"]
        metrics = srv.metrics()
        assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert "the draft model's" in srv.log_tail(20000)
    finally:
        srv.stop()
