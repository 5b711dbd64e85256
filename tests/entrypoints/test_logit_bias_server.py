"""logit_bias (OpenAI) and allowed_token_ids (vLLM extra) through the server and openai client."""
from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI

from conftest import API_KEY, MODEL
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.tokenizer.tokenizer import load_tokenizer

MESSAGES = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    return load_tokenizer(resolve_checkpoint(smollm_gguf).tokenizer_path)


@pytest.fixture(scope="module")
def purple(tokenizer) -> int:
    ids = tokenizer.encode(" purple", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_completion_logit_bias_forces_the_token(client, purple):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                    temperature=0, logit_bias={str(purple): 100})
    assert out.choices[0].text == " purple" * 4


def test_chat_logit_bias_forces_the_token(client, purple):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                         temperature=0, logit_bias={str(purple): 100})
    assert out.choices[0].message.content == " purple" * 3


def test_allowed_token_ids(client, tokenizer, purple):
    allowed = [purple] + tokenizer.encode(" banana", add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                    temperature=1.0, seed=0, extra_body={
                                        "allowed_token_ids": allowed, "ignore_eos": True})
    text = out.choices[0].text
    assert text and text.replace(" purple", "").replace(" banana", "") == ""


@pytest.mark.parametrize("body", [
    {"logit_bias": {"5": 100.5}},  # value out of [-100, 100]
    {"logit_bias": {"5": -101}},
    {"logit_bias": {"10000000": 1}},  # id outside the vocabulary
    {"logit_bias": {"-3": 1}},
    {"logit_bias": {"abc": 1}},  # not an integer key
])
def test_invalid_logit_bias_is_400_naming_it(client, body):
    for create in (lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                     extra_body=body),
                   lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                          max_tokens=2, extra_body=body)):
        with pytest.raises(BadRequestError) as err:
            create()
        assert err.value.status_code == 400
        assert err.value.body["param"] == "logit_bias", err.value.body


@pytest.mark.parametrize("ids", [[], [10_000_000], [-1]])
def test_invalid_allowed_token_ids_is_400_naming_it(client, ids):
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={"allowed_token_ids": ids})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "allowed_token_ids", err.value.body
