"""Decoders as embedding models (runner="pooling": Qwen3-Embedding's and gte-Qwen2's shape)
against transformers on tiny random Qwen2 and Qwen3: the last token's final hidden state,
normalised; prompts longer than the step's budget read in chunks give the same vectors; the
KV blocks are freed; a GGUF of the same weights pools the same; mean pooling is refused."""
from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pagedllm import LLM, PoolingParams
from tiny_models import VOCAB, base_fields, prompts, random_init, save_checkpoints

BUDGET = dict(max_num_batched_tokens=16, block_size=16)  # prompts of 5-61 tokens: chunked


def _last_states(model, token_prompts):
    rows = []
    for ids in token_prompts:
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        rows.append(h)
    return torch.stack(rows)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    if request.param == "qwen2":
        cfg = Qwen2Config(**common)
        model = Qwen2ForCausalLM(cfg).eval()
    else:
        cfg = Qwen3Config(head_dim=32, **common)
        model = Qwen3ForCausalLM(cfg).eval()
    random_init(model, seed=4, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp(request.param), request.param,
                            lambda w: base_fields(w, cfg), prompts((5, 23, 40, 61), seed=2))


def test_last_token_pooling_matches_transformers_in_chunks(tiny):
    llm = LLM(model=str(tiny.hf_dir), runner="pooling", dtype="float32", **BUDGET)
    config = llm.llm_engine.config
    assert config.runner == "pooling" and config.scheduler.chunked_pooling
    assert config.scheduler.max_num_batched_tokens == 16  # not raised to a whole input
    outs = llm.embed([{"prompt_token_ids": p} for p in tiny.prompts], use_tqdm=False)
    ours = torch.tensor([o.outputs.embedding for o in outs])
    ref = F.normalize(_last_states(tiny.model, tiny.prompts), dim=-1)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    raw = llm.embed({"prompt_token_ids": tiny.prompts[3]}, PoolingParams(normalize=False),
                    use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding),
                               _last_states(tiny.model, tiny.prompts[3:])[0], atol=5e-5,
                               rtol=1e-4)
    assert llm.llm_engine.engine_core.kv_manager.usage == 0
    with pytest.raises(ValueError, match="this model embeds and does not generate"):
        llm.generate("hi", use_tqdm=False)


def test_a_gguf_decoder_pools_the_same(tiny):
    llm = LLM(model=str(tiny.f32_gguf), tokenizer=str(tiny.hf_dir), task="embed",
              dtype="float32", **BUDGET)
    outs = llm.embed([{"prompt_token_ids": p} for p in tiny.prompts[:2]], use_tqdm=False)
    ref = F.normalize(_last_states(tiny.model, tiny.prompts[:2]), dim=-1)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outs]), ref,
                               atol=2e-5, rtol=1e-4)


def test_mean_pooling_and_parallel_decoders_are_refused(tiny, tmp_path):
    hf = tiny.hf_dir
    (hf / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (hf / "1_Pooling").mkdir(exist_ok=True)
    (hf / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    try:
        with pytest.raises(ValueError, match="mean pooling with a qwen[23] decoder is not "
                                             "implemented"):
            LLM(model=str(hf), runner="pooling", dtype="float32")
    finally:
        (hf / "modules.json").unlink()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with runner='pooling'"):
        LLM(model=str(hf), runner="pooling", dtype="float32", tensor_parallel_size=2)


def test_matryoshka_cuts_follow_the_config_as_for_bert(tiny):
    """dimensions only for a Matryoshka model (config.json's keys, here through hf_overrides
    as vLLM's docs do it): the last token's state cut to n values, then normalised."""
    full = _last_states(tiny.model, tiny.prompts[:2])
    prompts = [{"prompt_token_ids": p} for p in tiny.prompts[:2]]
    plain = LLM(model=str(tiny.hf_dir), runner="pooling", dtype="float32")
    with pytest.raises(ValueError, match=r"dimensions 16: Model does not support matryoshka "
                                         r"representation, changing output dimensions .*\(its "
                                         r"embeddings have 64 values\)"):
        plain.embed(prompts, PoolingParams(dimensions=16), use_tqdm=False)
    assert len(plain.embed(prompts[0], PoolingParams(dimensions=64),  # its own size: no cut
                           use_tqdm=False)[0].outputs.embedding) == 64
    del plain
    listed = LLM(model=str(tiny.hf_dir), runner="pooling", dtype="float32",
                 hf_overrides={"matryoshka_dimensions": [16, 32]})
    outs = listed.embed(prompts, PoolingParams(dimensions=16), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outs]),
                               F.normalize(full[:, :16], dim=-1), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"dimensions 20: Model only supports \[16, 32\] "
                                         r"matryoshka dimensions"):
        listed.embed(prompts, PoolingParams(dimensions=20), use_tqdm=False)
    del listed
    free = LLM(model=str(tiny.hf_dir), runner="pooling", dtype="float32",
               hf_overrides={"is_matryoshka": True})
    raw = free.embed(prompts[1], PoolingParams(dimensions=20, normalize=False),
                     use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), full[1, :20], atol=5e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions 65 is larger than the model's 64"):
        free.embed(prompts[1], PoolingParams(dimensions=65), use_tqdm=False)
