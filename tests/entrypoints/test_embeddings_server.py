"""/v1/embeddings through the openai SDK on a real server running all-MiniLM-L6-v2: every input
shape, float and base64, usage, the refusals by field; a pooling model refuses generation
endpoints and a generating one refuses embeddings, each naming what serves it."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from openai import BadRequestError, OpenAI
from torch.nn import functional as F

from conftest import API_KEY, MODEL, Server

NAME = "all-minilm-l6-v2"
TEXTS = ["The cat sits outside.", "A man is playing guitar.", "Paged attention uses blocks."]


@pytest.fixture(scope="module")
def embed_server(minilm_dir):
    srv = Server("--served-model-name", NAME, "--dtype", "float32", model=str(minilm_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(embed_server):
    return OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """transformers' BertModel, mean pooling and L2 normalisation (sentence-transformers')."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()

    def embed(texts):
        batch = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return F.normalize((h * mask).sum(1) / mask.sum(1), dim=1), batch["input_ids"]
    return embed


def _matrix(resp) -> torch.Tensor:
    return torch.tensor(np.array([d.embedding for d in resp.data], dtype=np.float32))


def test_texts_match_the_reference_as_floats_and_base64(client, reference):
    ref, ids = reference(TEXTS)
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == NAME
    assert F.cosine_similarity(_matrix(floats), ref).min() >= 0.9999
    tokens = int(ids.ne(0).sum())
    assert floats.usage.prompt_tokens == tokens == floats.usage.total_tokens
    b64 = client.embeddings.create(model=NAME, input=TEXTS)  # the SDK asks for base64 and decodes
    torch.testing.assert_close(_matrix(b64), _matrix(floats), atol=0, rtol=0)


def test_a_string_token_ids_and_lists_of_them(client, reference):
    ref, ids = reference(TEXTS[:2])
    one = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    first = ids[0][ids[0].ne(0)].tolist()
    by_ids = client.embeddings.create(model=NAME, input=first, encoding_format="float")
    torch.testing.assert_close(_matrix(by_ids), _matrix(one), atol=1e-6, rtol=0)
    lists = [row[row.ne(0)].tolist() for row in ids]
    many = client.embeddings.create(model=NAME, input=lists, encoding_format="float")
    assert F.cosine_similarity(_matrix(many), ref).min() >= 0.9999


def test_raw_base64_is_little_endian_float32(embed_server, client):
    body = {"model": NAME, "input": TEXTS[0], "encoding_format": "base64"}
    data = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(data["data"][0]["embedding"]), dtype="<f4")
    floats = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    assert np.array_equal(vec, np.array(floats.data[0].embedding, dtype=np.float32))


@pytest.mark.parametrize("kwargs,param,text", [
    (dict(dimensions=16), "dimensions", "does not support matryoshka representation"),
    (dict(input=""), "input", "must not be empty"),
    (dict(input=[]), "input", "must not be empty"),
    (dict(input=" ".join(["word"] * 300)), "input", "302 tokens long but max_model_len is 256"),
    (dict(input=[[101, 102], [101, 30522]]), "input[1]", "token ids in [0, 30522), got 30522"),
    (dict(extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens",
     "must be a positive int, -1"),
    (dict(extra_body={"truncate_prompt_tokens": 300}), "truncate_prompt_tokens",
     "larger than max_model_len (256)"),
])
def test_bad_requests_name_the_field(client, kwargs, param, text):
    kwargs = {"model": NAME, "input": "hello", "encoding_format": "float", **kwargs}
    with pytest.raises(BadRequestError) as info:
        client.embeddings.create(**kwargs)
    err = info.value.body
    assert err["param"] == param and text in err["message"], err


def test_a_pooling_model_refuses_generation_naming_embeddings(client, embed_server):
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    assert "/v1/chat/completions does not serve this model" in info.value.body["message"]
    assert "/v1/embeddings, /v2/embed, /pooling, /score, /v1/score, /rerank" in \
        info.value.body["message"]
    with pytest.raises(BadRequestError, match="/v1/embeddings"):
        client.completions.create(model=NAME, prompt="hi")
    models = httpx.get(f"{embed_server.url}/v1/models").json()["data"]
    assert models[0]["runner"] == "pooling" and models[0]["endpoints"] == [
        "/v1/embeddings", "/v2/embed", "/pooling", "/score", "/v1/score", "/rerank",
        "/v1/rerank", "/v2/rerank"]
    assert models[0]["max_model_len"] == 256


def test_a_generating_model_refuses_embeddings_naming_its_endpoints(server):
    gen = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(BadRequestError) as info:
        gen.embeddings.create(model=MODEL, input="hello")
    message = info.value.body["message"]
    assert "/v1/embeddings does not serve this model" in message
    assert "/v1/chat/completions" in message and info.value.body["param"] == "model"
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.json()["data"][0]["runner"] == "generate"


def test_rerank_and_score_by_the_cosine_of_embeddings(embed_server, reference):
    query, docs = "Who plays music?", TEXTS
    vecs, _ = reference([query, *docs])
    cos = (vecs[1:] @ vecs[0]).tolist()
    body = httpx.post(f"{embed_server.url}/v1/rerank", timeout=60,
                      json={"model": NAME, "query": query, "documents": docs}).json()
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -cos[i])
    assert body["results"][0]["index"] == 1  # the guitar
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert [got[i] for i in range(3)] == pytest.approx(cos, abs=1e-4)
    score = httpx.post(f"{embed_server.url}/score", timeout=60,
                       json={"text_1": query, "text_2": docs[1]}).json()
    assert score["data"][0]["score"] == pytest.approx(cos[1], abs=1e-4)


@pytest.mark.parametrize("path, body", [
    ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ("/score", {"text_1": "q", "text_2": "a"}),
    ("/v2/rerank", {"query": "q", "documents": ["a", "b"]}),
])
def test_a_truncation_past_max_model_len_is_a_400_on_the_scoring_endpoints(embed_server, path,
                                                                           body):
    # found by the API fuzzer: the embedding path of /rerank answered 500
    resp = httpx.post(f"{embed_server.url}{path}", timeout=60,
                      json={"model": NAME, **body, "truncate_prompt_tokens": 10 ** 25})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "truncate_prompt_tokens" and "larger than max_model_len" in \
        err["message"], err


def test_truncate_prompt_tokens_cuts_a_text_as_the_tokenizer_does(client, minilm_dir):
    from transformers import AutoTokenizer

    long = " ".join(["word"] * 300)
    resp = client.embeddings.create(model=NAME, input=long, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 256})
    assert resp.usage.prompt_tokens == 256
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    ids = tok(long, truncation=True, max_length=256)["input_ids"]
    again = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert np.allclose(resp.data[0].embedding, again.data[0].embedding, atol=1e-6)
