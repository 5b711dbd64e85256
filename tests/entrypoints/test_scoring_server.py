"""/score, /rerank (and /v1/rerank, /v2/rerank) and /classify on a real server: a tiny random
cross-encoder (BertForSequenceClassification, one label) against transformers, Jina's and
Cohere's rerank shapes (top_n, return_documents), the refusals by field; all-MiniLM-L6-v2's
rerank by the cosine of its embeddings; the endpoints each kind of model serves."""
from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from conftest import Server

QUERY = "what is the capital of france?"
DOCS = ["The cat sat on the mat.", "Paris is the capital and largest city of France.",
        "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, minilm_dir):
    """A random one-label BertForSequenceClassification with MiniLM's tokenizer."""
    path = tmp_path_factory.mktemp("ce") / "m"
    torch.manual_seed(3)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=1)).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def ce_server(cross_encoder_dir):
    srv = Server("--served-model-name", "ce", "--dtype", "float32", model=str(cross_encoder_dir))
    yield srv
    srv.stop()


def _reference(path, query, docs):
    tok = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]))
                for d in docs]


def _post(srv, path, body):
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def test_score_and_rerank_match_transformers(ce_server, cross_encoder_dir):
    ref = _reference(cross_encoder_dir, QUERY, DOCS)
    score = _post(ce_server, "/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2] and score["object"] == "list"
    assert [d["score"] for d in score["data"]] == pytest.approx(ref, abs=2e-6)
    assert score["usage"]["prompt_tokens"] > 0
    order = sorted(range(3), key=lambda i: -ref[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _post(ce_server, path, {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == order[:2], path
        assert body["results"][0]["document"] == {"text": DOCS[order[0]]}
        assert body["results"][0]["relevance_score"] == pytest.approx(ref[order[0]], abs=2e-6)
    bare = _post(ce_server, "/v1/rerank", {"query": QUERY, "documents": DOCS,
                                           "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]


def test_classify_and_the_endpoints_a_cross_encoder_serves(ce_server, cross_encoder_dir):
    body = _post(ce_server, "/classify", {"input": [QUERY, DOCS[0]]}).json()
    assert [d["num_classes"] for d in body["data"]] == [1, 1]
    assert body["data"][0]["label"] == "LABEL_0" and 0 < body["data"][0]["probs"][0] < 1
    models = httpx.get(f"{ce_server.url}/v1/models").json()["data"]
    assert models[0]["endpoints"] == ["/classify", "/pooling", "/score", "/v1/score", "/rerank",
                                      "/v1/rerank", "/v2/rerank"]
    pooled = _post(ce_server, "/pooling", {"input": [QUERY, DOCS[0]]}).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in body["data"]]
    bad = _post(ce_server, "/pooling", {"input": "hi", "task": "embed"}).json()["error"]
    assert bad["param"] == "task" and "not one this model serves" in bad["message"]
    err = _post(ce_server, "/v1/embeddings", {"input": "hi"})
    assert err.status_code == 400 and "/classify" in err.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param,text", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1",
     "text_1 has 2 texts and text_2 3"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2[1]", "must not be empty"),
    ("/score", {"text_1": "a", "text_2": " ".join(["word"] * 200)}, "text_2",
     "text_2 with its text_1 is 204 tokens long but max_model_len is 128"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query", "must not be empty"),
    ("/rerank", {"query": "q", "documents": []}, "documents", "non-empty list"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "must be >= 0"),
    ("/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens", "must be a positive int, -1"),
    ("/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 10 ** 25},
     "truncate_prompt_tokens", "larger than max_model_len"),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 10 ** 25},
     "truncate_prompt_tokens", "larger than max_model_len"),
    ("/classify", {"input": []}, "input", "non-empty list"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "not supported"),
    ("/classify", {"input": "a", "add_special_tokens": False}, "add_special_tokens",
     "not supported"),
])
def test_bad_requests_name_the_field(ce_server, path, body, param, text):
    resp = _post(ce_server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and text in err["message"], err


def test_truncation_fits_a_long_pair(ce_server):
    long = " ".join(["word"] * 200)
    body = _post(ce_server, "/score", {"text_1": QUERY, "text_2": long,
                                       "truncate_prompt_tokens": 128}).json()
    assert body["usage"]["prompt_tokens"] == 128 and 0 < body["data"][0]["score"] < 1
