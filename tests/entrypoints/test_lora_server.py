"""`serve --enable-lora --lora-modules`: an adapter is chosen by its name in `model`, answers as
the offline LLM does with the same adapter, and /v1/models lists it with parent and root."""
from __future__ import annotations

import gc
import json

import httpx
import pytest

from conftest import MODEL, Server
from pagedllm import LLM, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def lora_server(smollm_lora_adapters):
    one, two = smollm_lora_adapters
    srv = Server("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--max-model-len", "256", "--lora-modules", f"{one.lora_name}={one.lora_path}",
                 json.dumps({"name": two.lora_name, "path": two.lora_path,
                             "base_model_name": "smollm-base"}))
    yield srv
    srv.stop()


def _complete(srv: Server, model: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}, timeout=120)


def test_models_lists_the_adapters_with_parent_and_root(lora_server, smollm_lora_adapters):
    cards = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    one, two = smollm_lora_adapters
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (MODEL, None, MODEL), (one.lora_name, MODEL, one.lora_path),
        (two.lora_name, "smollm-base", two.lora_path)]


def test_the_model_field_picks_the_adapter_as_offline_lora_request_does(
        lora_server, smollm_gguf, smollm_lora_adapters):
    texts = {}
    for model in (MODEL, *(a.lora_name for a in smollm_lora_adapters)):
        r = _complete(lora_server, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # each adapter changes the answer
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
