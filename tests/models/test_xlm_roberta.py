"""XLM-RoBERTa encoders against transformers on tiny random models: the cross-encoder
(XLMRobertaForSequenceClassification, bge-reranker-v2-m3's shape: positions from padding_idx + 1,
no token types, dense + tanh + out_proj over <s>) scores pairs as transformers does, and
XLMRobertaModel (bge-m3's shape) embeds with its <s> row, normalised."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import (AutoTokenizer, XLMRobertaConfig, XLMRobertaForSequenceClassification,
                          XLMRobertaModel)

from pagedllm import LLM, PoolingParams
from pooling_models import XLMR_CORPUS, xlmr_tokenizer

QUERY = XLMR_CORPUS[0]
DOCS = XLMR_CORPUS[1:5]


def _config(**extra) -> XLMRobertaConfig:
    """XLM-R's layout (pad id 1, positions to padding_idx + 1 + 128, one token type)."""
    return XLMRobertaConfig(vocab_size=len(xlmr_tokenizer()), hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                            bos_token_id=0, eos_token_id=2, **extra)


def _save(model, path):
    with torch.no_grad():  # spread the weights out: transformers' 0.02 init scores near 0.5
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.normal_(0, 0.3 if "classifier" in name else 0.1)
    model.save_pretrained(path)
    xlmr_tokenizer().save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    torch.manual_seed(11)
    path, model = _save(XLMRobertaForSequenceClassification(_config(num_labels=1)),
                        tmp_path_factory.mktemp("xlmr") / "ce")
    return path, model, LLM(str(path), dtype="float32")


def _logits(path, model, first, second):
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.stack([model(**tok(a, b, return_tensors="pt")).logits[0]
                            for a, b in zip(first, second)])


def test_cross_encoder_scores_match_transformers(reranker):
    path, model, llm = reranker
    assert llm.llm_engine.config.scheduler.max_model_len == 128  # 130 rows less pad id + 1
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    ref = torch.sigmoid(_logits(path, model, [QUERY] * len(DOCS), DOCS)[:, 0])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref, atol=2e-6,
                               rtol=1e-5)
    assert outs[0].prompt_token_ids == AutoTokenizer.from_pretrained(path)(
        QUERY, DOCS[0])["input_ids"]
    raw = llm.score(DOCS[:2], DOCS[2:4], use_tqdm=False,
                    pooling_params=PoolingParams(use_activation=False))
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in raw]),
                               _logits(path, model, DOCS[:2], DOCS[2:4])[:, 0], atol=2e-6,
                               rtol=1e-5)
    assert llm.llm_engine.engine_core.kv_manager.usage == 0


def test_a_longest_input_reads_the_last_learned_position(reranker):
    path, model, llm = reranker
    long_doc = " ".join(DOCS * 6)
    out = llm.score(QUERY, long_doc, truncate_prompt_tokens=128, use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(QUERY, long_doc, truncation=True, max_length=128, return_tensors="pt")
    assert out.prompt_token_ids == enc["input_ids"][0].tolist() and len(out.prompt_token_ids) == 128
    with torch.no_grad():
        ref = torch.sigmoid(model(**enc).logits[0, 0])
    assert out.outputs.score == pytest.approx(float(ref), abs=2e-6)


def test_xlm_roberta_model_embeds_with_its_first_token(tmp_path):
    torch.manual_seed(12)
    path, model = _save(XLMRobertaModel(_config()), tmp_path / "emb")
    llm = LLM(str(path), dtype="float32")
    outs = llm.embed(DOCS, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        ref = torch.stack([model(**tok(d, return_tensors="pt")).last_hidden_state[0, 0]
                           for d in DOCS])
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outs]),
                               F.normalize(ref, dim=-1), atol=2e-6, rtol=1e-5)
