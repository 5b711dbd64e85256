"""`serve --enable-lora --lora-modules`: an adapter is chosen by its name in `model`, answers as
the offline LLM does with the same adapter, and /v1/models lists it with parent and root; with
VLLM_ALLOW_RUNTIME_LORA_UPDATING, adapters are loaded and unloaded while it runs."""
from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import httpx
import pytest

from conftest import API_KEY, MODEL, Server
from pagedllm import LLM, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def lora_server(smollm_lora_adapters):
    one, two = smollm_lora_adapters
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the server process inherits it
    try:
        srv = Server("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                     "--max-model-len", "256", "--lora-modules",
                     f"{one.lora_name}={one.lora_path}",
                     json.dumps({"name": two.lora_name, "path": two.lora_path,
                                 "base_model_name": "smollm-base"}))
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    yield srv
    srv.stop()


def _complete(srv: Server, model: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0},
        timeout=120)


def _answer(srv: Server, model: str) -> tuple[str, list[float]]:
    """The completion's text and its tokens' logprobs."""
    choice = _complete(srv, model).json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_models_lists_the_adapters_with_parent_and_root(lora_server, smollm_lora_adapters):
    cards = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    one, two = smollm_lora_adapters
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (MODEL, None, MODEL), (one.lora_name, MODEL, one.lora_path),
        (two.lora_name, "smollm-base", two.lora_path)]


def test_the_model_field_picks_the_adapter_as_offline_lora_request_does(
        lora_server, smollm_gguf, smollm_lora_adapters):
    texts, logprobs = {}, {}
    for model in (MODEL, *(a.lora_name for a in smollm_lora_adapters)):
        r = _complete(lora_server, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
        logprobs[model] = tuple(r.json()["choices"][0]["logprobs"]["token_logprobs"])
    assert len(set(logprobs.values())) == 3  # each adapter changes the answer
    llm = LLM(str(smollm_gguf), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    offline = llm.generate([PROMPT] * 3, params, use_tqdm=False,
                           lora_request=[None, *smollm_lora_adapters])
    del llm
    gc.collect()
    assert [o.outputs[0].text for o in offline] == list(texts.values())
    chat = httpx.post(f"{lora_server.url}/v1/chat/completions", json={
        "model": smollm_lora_adapters[1].lora_name, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
    assert chat.status_code == 200 and chat.json()["model"] == "adapter2"


def test_an_unknown_model_is_a_404_naming_the_adapters(lora_server):
    r = _complete(lora_server, "adapter3")
    assert r.status_code == 404
    assert "this server serves smollm2-135m-instruct, adapter1, adapter2" in r.text


def _post(srv: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=120)


def test_adapters_load_and_unload_at_run_time_without_stale_weights(lora_server,
                                                                     smollm_lora_adapters):
    one, two = smollm_lora_adapters
    answers = {a.lora_name: _answer(lora_server, a.lora_name) for a in smollm_lora_adapters}
    r = _post(lora_server, "/v1/load_lora_adapter",
              {"lora_name": "late", "lora_path": two.lora_path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert _answer(lora_server, "late") == answers["adapter2"]
    assert "late" in [c["id"] for c in httpx.get(f"{lora_server.url}/v1/models").json()["data"]]
    again = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "/x"})
    assert again.status_code == 400 and "has already been loaded" in again.text
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert _complete(lora_server, "late").status_code == 404
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    # the same name for another adapter: a new id, so nothing of the old one is served
    assert _post(lora_server, "/v1/load_lora_adapter",
                 {"lora_name": "late", "lora_path": one.lora_path}).status_code == 200
    assert _answer(lora_server, "late") == answers["adapter1"]
    bad = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nope"})
    assert bad.status_code == 400 and "lora_path '/nope' is not a local directory" in bad.text


def test_a_gguf_adapter_loads_at_run_time_and_answers_as_its_peft_original(
        lora_server, smollm_lora_adapters, smollm_gguf, lora_gguf_writer, tmp_path):
    """llama.cpp's GGUF LoRA file (written from adapter1 in its converter's layout)."""
    one = smollm_lora_adapters[0]
    path = lora_gguf_writer(Path(one.lora_path), tmp_path / "one.gguf", "llama", 64)  # head_dim
    r = _post(lora_server, "/v1/load_lora_adapter",
              {"lora_name": "one-gguf", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert _answer(lora_server, "one-gguf") == _answer(lora_server, one.lora_name)
    bad = _post(lora_server, "/v1/load_lora_adapter",
                {"lora_name": "model", "lora_path": str(smollm_gguf)})
    assert bad.status_code == 400 and "not a LoRA adapter" in bad.text


def test_runtime_loading_is_off_without_the_environment_variable(server):
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404


def test_metrics_have_the_lora_series(lora_server):
    """(The adapters' names in it: tests/e2e/test_lora.py, where no race decides.)"""
    lora_server.wait_idle()
    page = httpx.get(f"{lora_server.url}/metrics").text
    assert ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
            'waiting_lora_adapters=""}') in page
