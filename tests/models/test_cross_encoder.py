"""Cross-encoders and classifiers (BertForSequenceClassification) against transformers on tiny
random models: LLM.score's sigmoid relevance of (query, document) pairs, told apart by token
type; LLM.classify's softmax over three labels; raw logits with use_activation=False; pairs cut
by truncate_prompt_tokens as the tokenizer's truncation=True cuts them; and the embedding model's
score, the cosine of the real all-MiniLM-L6-v2's embeddings."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from pagedllm import LLM, PoolingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")
QUERY = "what is the capital of france?"
DOCS = ["Paris is the capital and largest city of France.", "The cat sat on the mat.",
        "Berlin is the capital of Germany.", "a"]


def tiny_classifier(path: Path, minilm_dir: Path, labels: int, seed: int = 0,
                    **config) -> Path:
    """A random BertForSequenceClassification (a distinct token-type table, so the pair's
    types matter) saved with MiniLM's tokenizer."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                     type_vocab_size=2, num_labels=labels, **config)
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # outputs far from 0.5, and a type table that tells the texts apart
        model.bert.embeddings.token_type_embeddings.weight.normal_(0, 0.5)
        model.classifier.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, path / name)
    return path


def logits(path: Path, first: list[str], second: list[str] | None = None,
           max_length: int | None = None) -> torch.Tensor:
    """transformers' logits, one input (or pair) at a time, no padding."""
    tok = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for i, text in enumerate(first):
        pair = None if second is None else second[i]
        enc = tok(text, pair, return_tensors="pt", truncation=max_length is not None,
                  max_length=max_length)
        with torch.no_grad():
            rows.append(model(**enc).logits[0])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_dir):
    path = tiny_classifier(tmp_path_factory.mktemp("ce") / "m", minilm_dir, labels=1)
    return path, LLM(str(path), device="cpu", dtype="float32")


def test_score_is_the_sigmoid_of_the_pair_logit(cross_encoder):
    path, llm = cross_encoder
    outs = llm.score(QUERY, DOCS, use_tqdm=False)  # one query against every document, one step
    ref = torch.sigmoid(logits(path, [QUERY] * len(DOCS), DOCS)[:, 0])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref, atol=2e-6,
                               rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(path)
    assert outs[0].prompt_token_ids == tok(QUERY, DOCS[0])["input_ids"]
    # side by side, and the raw logit without the activation
    raw = llm.score([QUERY, DOCS[1]], [DOCS[0], DOCS[2]], use_tqdm=False,
                    pooling_params=PoolingParams(use_activation=False))
    ref = logits(path, [QUERY, DOCS[1]], [DOCS[0], DOCS[2]])[:, 0]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in raw]), ref, atol=2e-6,
                               rtol=1e-5)
    assert llm.llm_engine.engine_core.kv_manager.usage == 0


def test_the_second_text_has_token_type_one(cross_encoder):
    """The logits are transformers' with the pair's token types, and differ from those with
    every token of type 0 (what an embedding input gets)."""
    path, llm = cross_encoder
    ours = torch.tensor([o.outputs.score for o in llm.score(
        QUERY, DOCS[:3], use_tqdm=False, pooling_params=PoolingParams(use_activation=False))])
    tok = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    typed, untyped = [], []
    for doc in DOCS[:3]:
        enc = tok(QUERY, doc, return_tensors="pt")
        with torch.no_grad():
            typed.append(model(**enc).logits[0, 0])
            untyped.append(model(input_ids=enc["input_ids"]).logits[0, 0])
    torch.testing.assert_close(ours, torch.stack(typed), atol=2e-6, rtol=1e-5)
    assert (ours - torch.stack(untyped)).abs().min() > 1e-3


def test_truncation_cuts_the_pair_as_the_tokenizer_does(cross_encoder):
    path, llm = cross_encoder
    outs = llm.score(QUERY, DOCS[:3], truncate_prompt_tokens=12, use_tqdm=False)
    assert all(len(o.prompt_token_ids) == 12 for o in outs)
    ref = torch.sigmoid(logits(path, [QUERY] * 3, DOCS[:3], max_length=12)[:, 0])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref, atol=2e-6,
                               rtol=1e-5)


def test_refusals_name_what_serves(cross_encoder):
    _, llm = cross_encoder
    with pytest.raises(ValueError, match="task 'embed' is not one this model serves"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"data_2\[1\] must not be empty"):
        llm.score("a", ["b", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.score("a", " ".join(["word"] * 200), use_tqdm=False)


def test_classify_is_the_softmax_over_the_labels(tmp_path, minilm_dir):
    path = tiny_classifier(tmp_path / "m", minilm_dir, labels=3, seed=1,
                           id2label={0: "neg", 1: "neu", 2: "pos"},
                           label2id={"neg": 0, "neu": 1, "pos": 2})
    llm = LLM(str(path), device="cpu", dtype="float32")
    texts = [QUERY, *DOCS]
    outs = llm.classify(texts, use_tqdm=False)
    ref = torch.softmax(logits(path, texts), dim=-1)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, atol=2e-6,
                               rtol=1e-5)
    assert outs[0].outputs.num_classes == 3
    assert llm.llm_engine.config.arch.classifier.labels == ("neg", "neu", "pos")
    with pytest.raises(ValueError, match="only a one-label head scores a pair"):
        llm.score("a", "b", use_tqdm=False)


def test_problem_type_and_sentence_transformers_activation(tmp_path, minilm_dir):
    path = tiny_classifier(tmp_path / "m", minilm_dir, labels=1, seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sbert_ce_default_activation_function"] = "torch.nn.modules.linear.Identity"
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), device="cpu", dtype="float32")
    score = llm.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score
    assert score == pytest.approx(float(logits(path, [QUERY], [DOCS[0]])[0, 0]), abs=2e-6)
    cfg["sbert_ce_default_activation_function"] = "torch.nn.modules.activation.Tanh"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activation_fn 'torch.nn.modules.activation.Tanh' is "
                                         "not supported"):
        LLM(str(path), device="cpu", dtype="float32")


def test_an_embedding_model_scores_by_cosine(minilm_dir):
    """The real all-MiniLM-L6-v2: score is the cosine of sentence-transformers' embeddings
    (mean pooling, normalised), computed by hand with transformers."""
    from transformers import AutoModel

    llm = LLM(str(minilm_dir), device="cpu", dtype="float32")
    outs = llm.score(QUERY, DOCS[:3], use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    batch = tok([QUERY, *DOCS[:3]], padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    vecs = F.normalize((h * mask).sum(1) / mask.sum(1), dim=1)
    ref = vecs[1:] @ vecs[0]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref, atol=1e-5,
                               rtol=1e-4)
    assert max(range(3), key=lambda i: outs[i].outputs.score) == 0  # Paris first
    # truncation: a text cut from the right with its [SEP] kept, as the tokenizer cuts
    cut = llm.embed(DOCS[0], PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == tok(DOCS[0], truncation=True, max_length=6)["input_ids"]
    ids = tok(DOCS[0])["input_ids"]
    last = llm.encode({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=5),
                      use_tqdm=False)[0]
    assert last.prompt_token_ids == ids[-5:]  # token ids: the last k, as vLLM keeps them
