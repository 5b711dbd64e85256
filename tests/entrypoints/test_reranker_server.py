"""Rerankers other than BERT's through a server: Qwen3-Reranker served as vLLM serves it
(`serve --hf-overrides JSON`): /rerank and /score on a tiny random Qwen3 causal LM equal
sigmoid(logit(yes) - logit(no)) from transformers; a bad --hf-overrides is refused before the
server starts, naming the flag; an XLM-RoBERTa cross-encoder (bge-reranker-v2-m3's shape)
reranks as transformers scores."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import (AutoTokenizer, Qwen3ForCausalLM, XLMRobertaConfig,
                          XLMRobertaForSequenceClassification)

from conftest import Server
from pooling_models import (RERANKER, XLMR_CORPUS, reranker_pairs, tiny_qwen3, xlmr_tokenizer,
                            yes_no_scores)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = tmp_path_factory.mktemp("rr") / "m"
    model = tiny_qwen3(Qwen3ForCausalLM, path, seed=5)
    srv = Server("--served-model-name", "rr", "--dtype", "float32", "--hf-overrides",
                 json.dumps(RERANKER), model=str(path))
    yield path, model, srv
    srv.stop()


def test_rerank_and_score_are_the_yes_no_sigmoid(reranker):
    path, model, srv = reranker
    queries, docs = reranker_pairs()
    ref = yes_no_scores(path, model, [queries[0]] * len(docs), docs)
    body = {"model": "rr", "query": queries[0], "documents": docs}
    out = httpx.post(f"{srv.url}/v1/rerank", json=body, timeout=60).json()
    by_index = {r["index"]: r["relevance_score"] for r in out["results"]}
    assert by_index == {i: pytest.approx(float(s), abs=1e-5) for i, s in enumerate(ref)}
    assert [r["index"] for r in out["results"]] == sorted(range(len(docs)), key=lambda i: -ref[i])
    score = httpx.post(f"{srv.url}/score", json={"model": "rr", "text_1": queries,
                                                 "text_2": docs}, timeout=60).json()
    side = yes_no_scores(path, model, queries, docs)
    assert [d["score"] for d in score["data"]] == [pytest.approx(float(s), abs=1e-5)
                                                  for s in side]
    models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]
    assert "/rerank" in models["endpoints"] and "/v1/embeddings" not in models["endpoints"]


@pytest.mark.parametrize("value,message", [
    ("{not json", "--hf-overrides: not JSON"),
    ("[1, 2]", "--hf-overrides: must be a JSON object"),
])
def test_a_bad_hf_overrides_flag_is_refused(value, message):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "x",
                           "--hf-overrides", value], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_an_xlm_roberta_cross_encoder_reranks_as_transformers(tmp_path):
    torch.manual_seed(13)
    tok = xlmr_tokenizer()
    model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, type_vocab_size=1,
        num_labels=1)).eval()
    with torch.no_grad():
        model.classifier.out_proj.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    query, docs = XLMR_CORPUS[0], XLMR_CORPUS[1:5]
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        ref = [float(torch.sigmoid(model(**hf_tok(query, d, return_tensors="pt")).logits[0, 0]))
               for d in docs]
    srv = Server("--served-model-name", "xr", "--dtype", "float32", model=str(tmp_path))
    try:
        out = httpx.post(f"{srv.url}/v2/rerank", json={"model": "xr", "query": query,
                                                       "documents": docs, "top_n": 2},
                         timeout=60).json()
    finally:
        srv.stop()
    best = sorted(range(len(docs)), key=lambda i: -ref[i])[:2]
    assert [r["index"] for r in out["results"]] == best
    assert [r["relevance_score"] for r in out["results"]] == [pytest.approx(ref[i], abs=2e-6)
                                                              for i in best]
