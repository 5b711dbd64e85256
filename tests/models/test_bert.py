"""BERT-family encoders against transformers' BertModel on tiny random models: CLS, mean and
last-token pooling, normalised or not, Matryoshka dimensions, the encoder's variants (GELU or
tanh-GELU, one token type), and many inputs of different lengths packed into one step."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import BertConfig, BertModel

from pagedllm import LLM, PoolingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")
TEXTS = ["Hello world", "The cat sat on the mat.", "a", "Embeddings map sentences to vectors, "
         "so that similar sentences land near each other.", "query: what is pagedllm?"]


def tiny_bert(path: Path, minilm_dir: Path, modules: list[str] | None = None,
              pooling: str | None = None, seed: int = 0, **overrides) -> Path:
    """A random BertModel saved with MiniLM's tokenizer (and sentence-transformers files when
    `modules` lists Pooling/Normalize)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=128, type_vocab_size=2)
    cfg.update(overrides)
    model = BertModel(BertConfig(**cfg)).eval()
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, path / name)
    if modules is not None:
        kinds = ["Transformer", *modules]
        (path / "modules.json").write_text(json.dumps([
            {"idx": i, "name": str(i), "path": "1_Pooling" if k == "Pooling" else "",
             "type": f"sentence_transformers.models.{k}"} for i, k in enumerate(kinds)]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": cfg["hidden_size"], "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_lasttoken": pooling == "last"}))
    return path


def reference(path: Path, texts: list[str], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' BertModel, one input at a time (no padding), pooled by hand."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for text in texts:
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            h = model(**ids).last_hidden_state[0]  # [S, H]
        vec = {"cls": h[0], "mean": h.mean(0), "last": h[-1]}[pooling]
        rows.append(F.normalize(vec, dim=0) if normalize else vec)
    return torch.stack(rows)


def embed(llm: LLM, texts, params=None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, params, use_tqdm=False)])


@pytest.fixture(scope="module")
def cls_model(tmp_path_factory, minilm_dir):
    """No sentence-transformers files: vLLM's default for BertModel, CLS and normalised."""
    path = tiny_bert(tmp_path_factory.mktemp("bert-cls"), minilm_dir)
    return path, LLM(str(path), device="cpu", dtype="float32")


def test_cls_pooling_by_default_matches_transformers(cls_model):
    path, llm = cls_model
    ours, ref = embed(llm, TEXTS), reference(path, TEXTS, "cls", True)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_many_inputs_of_every_length_pack_into_one_step(cls_model, monkeypatch):
    path, llm = cls_model
    texts = [" ".join(["word"] * n) for n in range(0, 40, 3)]
    texts[0] = "x"
    token_prompt = {"prompt_token_ids": [101]}  # a one-token input runs among the others
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    monkeypatch.setattr(runner, "sampler", lambda *a: pytest.fail("a pooling step sampled"))
    steps = []
    execute = runner.execute_model
    monkeypatch.setattr(runner, "execute_model",
                        lambda sched: steps.append(dict(sched.num_scheduled_tokens)) or
                        execute(sched))
    outs = llm.embed([*texts, token_prompt], use_tqdm=False)
    assert len(steps) == 1 and len(steps[0]) == len(texts) + 1  # all in one step
    ours = torch.tensor([o.outputs.embedding for o in outs])
    ref = reference(path, texts, "cls", True)
    torch.testing.assert_close(ours[:-1], ref, atol=2e-5, rtol=1e-4)
    model = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(torch.tensor([[101]])).last_hidden_state[0, 0]
    torch.testing.assert_close(ours[-1], F.normalize(h, dim=0), atol=2e-5, rtol=1e-4)
    assert outs[-1].prompt_token_ids == [101]
    kv = llm.llm_engine.engine_core.kv_manager
    assert kv.usage == 0  # no block is kept after the step


def test_normalize_false_gives_the_raw_cls_state(cls_model):
    path, llm = cls_model
    ours = embed(llm, TEXTS[:2], PoolingParams(normalize=False))
    torch.testing.assert_close(ours, reference(path, TEXTS[:2], "cls", False), atol=5e-5,
                               rtol=1e-4)


def test_unsupported_requests_are_refused_by_name(cls_model):
    _, llm = cls_model
    with pytest.raises(ValueError, match="Model does not support matryoshka representation"):
        llm.embed("hi", PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be a positive int, -1"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="task 'rank' is not supported"):
        PoolingParams(task="rank")
    with pytest.raises(ValueError, match="task 'classify' is not one this model serves "
                                         r"\(embed\): it has no classification head"):
        llm.classify("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="embeds and does not generate"):
        llm.generate("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.embed(" ".join(["word"] * 200), use_tqdm=False)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("last", False), ("cls", True)])
def test_sentence_transformers_files_choose_the_pooling(tmp_path, minilm_dir, pooling,
                                                        normalize):
    modules = ["Pooling", "Normalize"] if normalize else ["Pooling"]
    path = tiny_bert(tmp_path / "m", minilm_dir, modules, pooling, seed=1,
                     hidden_act="gelu_new", layer_norm_eps=1e-5, type_vocab_size=1)
    llm = LLM(str(path), device="cpu", dtype="float32")
    torch.testing.assert_close(embed(llm, TEXTS), reference(path, TEXTS, pooling, normalize),
                               atol=5e-5, rtol=1e-4)


def test_matryoshka_dimensions_cut_then_normalise(tmp_path, minilm_dir):
    path = tiny_bert(tmp_path / "m", minilm_dir, ["Pooling", "Normalize"], "mean", seed=2,
                     is_matryoshka=True, matryoshka_dimensions=[16, 32, 64])
    llm = LLM(str(path), device="cpu", dtype="float32")
    full = reference(path, TEXTS, "mean", False)
    ours = embed(llm, TEXTS, PoolingParams(dimensions=16))
    torch.testing.assert_close(ours, F.normalize(full[:, :16], dim=1), atol=5e-5, rtol=1e-4)
    with pytest.raises(ValueError,
                       match=r"dimensions 20: Model only supports \[16, 32, 64\] matryoshka"):
        llm.embed("hi", PoolingParams(dimensions=20), use_tqdm=False)
