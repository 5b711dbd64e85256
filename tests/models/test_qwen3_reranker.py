"""Qwen3-Reranker's yes/no scoring (vLLM's hf_overrides: architectures
Qwen3ForSequenceClassification, classifier_from_token ["no", "yes"],
is_original_qwen3_reranker) against transformers on a tiny random Qwen3ForCausalLM: each
(query, document) pair's score is sigmoid(logit(yes) - logit(no)) at the last position; a
checkpoint converted to Qwen3ForSequenceClassification (score.weight) scores as transformers'
class does; hf_overrides keys nothing reads, and what the conversion cannot serve, are refused
by name."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification)

from pagedllm import LLM, PoolingParams
from pooling_models import (RERANKER, reranker_pairs, tiny_qwen3, yes_no_scores,
                            yes_no_tokenizer)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def reranker(request, tmp_path_factory):
    """A tiny random Qwen3ForCausalLM (Qwen3-Reranker's shape) saved with its tokenizer."""
    path = tmp_path_factory.mktemp("rr") / "m"
    return path, tiny_qwen3(Qwen3ForCausalLM, path, seed=7, tie_word_embeddings=request.param)


def test_yes_no_score_matches_transformers(reranker):
    path, model = reranker
    llm = LLM(str(path), runner="pooling", hf_overrides=RERANKER, dtype="float32",
              max_num_batched_tokens=64, block_size=16)  # prompts of ~200 tokens: chunked
    config = llm.llm_engine.config
    assert config.runner == "pooling" and config.pooler.pooling_type == "last"
    assert config.arch.classifier.from_tokens == ("no", "yes")
    queries, docs = reranker_pairs()
    outs = llm.score(queries, docs, use_tqdm=False)
    ref = yes_no_scores(path, model, queries, docs)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref, atol=1e-5,
                               rtol=0)
    # one query against both documents; classify's probability is the same sigmoid
    one = llm.score(queries[0], docs, use_tqdm=False)
    ref_one = yes_no_scores(path, model, [queries[0]] * 2, docs)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in one]), ref_one, atol=1e-5,
                               rtol=0)
    probs = llm.classify([queries[1] + docs[1]], use_tqdm=False)[0].outputs.probs
    assert probs == pytest.approx([float(ref[1])], abs=1e-5)
    raw = llm.score(queries[1], docs[1], use_tqdm=False,
                    pooling_params=PoolingParams(use_activation=False))[0].outputs.score
    assert raw == pytest.approx(float(torch.logit(ref[1].double())), abs=1e-4)
    assert llm.llm_engine.engine_core.kv_manager.usage == 0
    with pytest.raises(ValueError, match="does not embed"):
        llm.embed("hi", use_tqdm=False)


def test_vllms_method_spelling_converts_the_same(reranker):
    """method from_2_way_softmax (vLLM's general spelling) instead of the Qwen3 flag."""
    path, model = reranker
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"}
    llm = LLM(str(path), hf_overrides=overrides, dtype="float32")  # runner auto: it pools
    queries, docs = reranker_pairs()
    torch.testing.assert_close(
        torch.tensor([o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)]),
        yes_no_scores(path, model, queries, docs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls,config_cls", [
    (Qwen3ForSequenceClassification, Qwen3Config), (Qwen2ForSequenceClassification, Qwen2Config)])
def test_a_converted_sequence_classification_checkpoint(tmp_path, cls, config_cls):
    """Qwen3/Qwen2ForSequenceClassification with its own score.weight (no overrides)."""
    model = tiny_qwen3(cls, tmp_path, seed=8, config_cls=config_cls, num_labels=1,
                       pad_token_id=len(yes_no_tokenizer()) - 1)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")  # runner auto: a classifier pools
    queries, docs = reranker_pairs()
    outs = llm.score(queries, docs, use_tqdm=False)
    with torch.no_grad():
        ref = [torch.sigmoid(model(torch.tensor([tok(q, d)["input_ids"]])).logits[0, 0])
               for q, d in zip(queries, docs)]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]),
                               torch.stack(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides,message", [
    ({**RERANKER, "foo_bar": 1}, r"hf_overrides \['foo_bar'\]: pagedllm does not read this key"),
    ({"is_original_qwen3_reranker": True},  # still a causal LM: nothing reads the flag
     r"hf_overrides \['is_original_qwen3_reranker'\]"),
    ({**RERANKER, "classifier_from_token": ["no", "maybe"]},
     "classifier_from_token 'maybe' is not a token of the model's vocabulary"),
    ({**RERANKER, "classifier_from_token": ["yes"]}, "classifier_from_token must name two"),
    ({**RERANKER, "method": "no_post_processing"}, "method='no_post_processing' is not"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]},
     "classifier_from_token needs method='from_2_way_softmax' or is_original_qwen3_reranker"),
])
def test_overrides_that_cannot_be_honoured_are_refused(reranker, overrides, message):
    path, _ = reranker
    with pytest.raises(ValueError, match=message):
        LLM(str(path), runner="pooling", hf_overrides=overrides, dtype="float32")


def test_the_classifier_refuses_generate_and_quantization(reranker):
    path, _ = reranker
    with pytest.raises(ValueError, match="runner='generate': this qwen3 checkpoint has a "
                                         "classification head"):
        LLM(str(path), runner="generate", hf_overrides=RERANKER, dtype="float32")
    with pytest.raises(ValueError, match="quantization='int8' with a classifier qwen3"):
        LLM(str(path), hf_overrides=RERANKER, quantization="int8")
    with pytest.raises(ValueError, match="hf_overrides as a function is not supported"):
        LLM(str(path), hf_overrides=lambda cfg: cfg)
    # without the overrides the same checkpoint is a plain causal LM
    assert json.loads((path / "config.json").read_text())["architectures"] == \
        ["Qwen3ForCausalLM"]
