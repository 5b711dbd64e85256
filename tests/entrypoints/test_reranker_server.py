"""Qwen3-Reranker served as vLLM serves it (`serve --hf-overrides JSON`): /rerank and /score
on a tiny random Qwen3 causal LM equal sigmoid(logit(yes) - logit(no)) from transformers; a bad
--hf-overrides is refused before the server starts, naming the flag."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from transformers import Qwen3ForCausalLM

from conftest import Server
from pooling_models import RERANKER, reranker_pairs, tiny_qwen3, yes_no_scores


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
