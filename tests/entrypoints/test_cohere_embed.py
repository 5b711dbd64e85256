"""Cohere's /v2/embed (vLLM's) on a real server running a tiny random BERT whose
config_sentence_transformers.json names query/document prompts: input_type puts its prompt
before each text, as sentence-transformers' encode(prompt_name=...) does (the prompt's tokens
pooled too: include_prompt), against transformers' BertModel with mean pooling; no input_type,
no prompt (default_prompt_name is not applied, as in vLLM, nor by /v1/embeddings); embedding
types, truncation and the refusals by field."""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from torch.nn import functional as F
from transformers import AutoTokenizer, BertConfig, BertModel

from conftest import Server

PROMPTS = {"query": "query: ", "document": "passage: ", "empty": ""}
TEXTS = ["how do llamas live?", "Llamas live in the Andes and are kept for their wool."]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, minilm_dir):
    """A random BertModel with MiniLM's tokenizer, mean pooling and prompts (a default one
    too: sentence-transformers would apply it, vLLM does not)."""
    path = tmp_path_factory.mktemp("prompted-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=128)).eval().save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, path / name)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": PROMPTS, "default_prompt_name": "query", "similarity_fn_name": "cosine"}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server("--served-model-name", "bert", "--dtype", "float32", model=str(model_dir))
    yield srv
    srv.stop()


def _reference(model_dir, texts: list[str], **cut) -> torch.Tensor:
    """sentence-transformers' pipeline by hand: mean over the mask, L2-normalised (cut: the
    tokenizer's truncation arguments)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = BertModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt", **cut)
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((h * mask).sum(1) / mask.sum(1), dim=1)


def _embed(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/embed", json={"model": "bert", **body}, timeout=60)


def _floats(resp: httpx.Response) -> torch.Tensor:
    assert resp.status_code == 200, resp.text
    return torch.tensor(resp.json()["embeddings"]["float"])


@pytest.mark.parametrize("input_type", ["query", "document", "empty", None])
def test_input_type_puts_the_models_prompt_first(server, model_dir, input_type):
    ours = _floats(_embed(server, texts=TEXTS, **({} if input_type is None else
                                                   {"input_type": input_type})))
    prompt = PROMPTS.get(input_type, "")  # no input_type: no prompt, default_prompt_name or not
    ref = _reference(model_dir, [prompt + t for t in TEXTS])
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    if input_type == "query":  # and the prompt changes the vector
        assert F.cosine_similarity(ours, _reference(model_dir, TEXTS)).max() < 0.9999


def test_the_answer_is_cohere_shaped_and_v1_embeddings_applies_no_prompt(server, model_dir):
    resp = _embed(server, texts=TEXTS, input_type="query",
                  embedding_types=["float", "base64", "binary", "ubinary"])
    body = resp.json()
    assert body["texts"] == TEXTS and body["meta"]["api_version"] == {"version": "2"}
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert body["meta"]["tokens"]["input_tokens"] == sum(
        len(tok("query: " + t)["input_ids"]) for t in TEXTS)
    floats = np.array(body["embeddings"]["float"], dtype=np.float32)
    decoded = np.stack([np.frombuffer(base64.b64decode(b), "<f4")
                        for b in body["embeddings"]["base64"]])
    assert np.array_equal(decoded, floats)
    bits = np.packbits(floats >= 0, axis=1)
    assert body["embeddings"]["ubinary"] == bits.tolist()
    assert body["embeddings"]["binary"] == (bits.astype(int) - 128).tolist()
    v1 = httpx.post(f"{server.url}/v1/embeddings", json={"model": "bert", "input": TEXTS},
                    timeout=60).json()
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in v1["data"]]),
                               _reference(model_dir, TEXTS), atol=2e-5, rtol=0)


def test_truncation(server, model_dir):
    long = " ".join(["llama"] * 200)  # 202 tokens, more than max_model_len 128
    cut = _floats(_embed(server, texts=[long], max_tokens=10))
    ref = _reference(model_dir, [long], truncation=True, max_length=10)
    torch.testing.assert_close(cut, ref, atol=2e-5, rtol=0)
    assert _embed(server, texts=[long]).status_code == 200  # END: cut to max_model_len
    refused = _embed(server, texts=["a few words", " ".join(["llama"] * 20)],
                     truncate="NONE", max_tokens=10)  # 42 tokens
    assert refused.status_code == 400
    assert "texts[1] is 42 tokens long, more than max_tokens=10" in refused.text
    refused = _embed(server, texts=[long], truncate="NONE")
    assert refused.status_code == 400 and "max_model_len is 128" in refused.text
    assert "set truncate to 'END'" in refused.text


@pytest.mark.parametrize("body, words", [
    ({"texts": TEXTS, "input_type": "classification"},
     "input_type 'classification' is not supported; supported: document, empty, query"),
    ({"images": ["data:image/png;base64,AAAA"]}, "images is not supported"),
    ({"inputs": [{"content": [{"type": "text", "text": "x"}]}]}, "inputs is not supported"),
    ({}, "texts must be given"),
    ({"texts": []}, "texts must not be empty"),
    ({"texts": TEXTS, "truncate": "START"}, "truncate='START'"),
    ({"texts": TEXTS, "priority": 1}, "priority is not supported"),
    ({"texts": TEXTS, "embedding_types": ["int8"]}, "embedding_types"),
    ({"texts": TEXTS, "output_dimension": 8}, "dimensions"),
])
def test_refusals_name_the_field(server, body, words):
    resp = _embed(server, **body)
    assert resp.status_code == 400 and words in resp.text, resp.text
