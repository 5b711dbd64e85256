"""Reading a pooling model's files: BERT's config.json (what the encoder does not run refused by
its key) and sentence-transformers' modules.json and Pooling config (CLS, mean, last token,
Normalize; any other module or mode refused by name)."""
from __future__ import annotations

import json

import pytest

from pagedllm.config import PoolerConfig
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.hf.arch import arch_from_hf_config
from pagedllm.loader.hf.pooling_files import DEFAULT_POOLER, pooler_config

BERT = dict(architectures=["BertModel"], model_type="bert", vocab_size=100, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
            hidden_act="gelu")


def test_bert_config_reads_the_encoder_fields():
    arch = arch_from_hf_config(BERT)
    assert arch.architecture == "bert" and arch.is_encoder
    assert (arch.encoder.type_vocab_size, arch.encoder.layer_norm_eps, arch.encoder.hidden_act) \
        == (2, 1e-12, "gelu")
    assert arch.head_dim == 8 and not arch.is_matryoshka
    # embeddings (word, position, type, LayerNorm) + 2 x (q/k/v/o, MLP, two LayerNorms)
    assert arch.num_params() == (100 + 64 + 2 + 2) * 32 + 2 * (4 * (32 * 32 + 32) + 2 * 32 * 64
                                                               + 64 + 32 + 4 * 32)


@pytest.mark.parametrize("key,value,message", [
    ("position_embedding_type", "relative_key", "position_embedding_type='relative_key' is not"),
    ("hidden_act", "silu", "hidden_act='silu' is not supported"),
    ("type_vocab_size", 0, "type_vocab_size must be >= 1"),
    ("matryoshka_dimensions", "64", "matryoshka_dimensions must be a non-empty list"),
])
def test_what_the_encoder_does_not_run_is_refused_by_key(key, value, message):
    with pytest.raises(ModelFileError, match=message):
        arch_from_hf_config({**BERT, key: value}, "cfg.json")


def _st_folder(tmp_path, modules, pooling=None):
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_no_sentence_transformers_files_means_cls_normalised(tmp_path):
    assert pooler_config(tmp_path) == DEFAULT_POOLER == PoolerConfig("cls", True)


@pytest.mark.parametrize("pooling,expected", [
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "lasttoken"}, "last"),
])
def test_the_pooling_module_names_the_mode(tmp_path, pooling, expected):
    folder = _st_folder(tmp_path, ["Transformer", "Pooling", "Normalize"], pooling)
    assert pooler_config(folder) == PoolerConfig(expected, True)
    (folder / "modules.json").write_text(json.dumps(json.loads(
        (folder / "modules.json").read_text())[:2]))
    assert pooler_config(folder) == PoolerConfig(expected, False)  # no Normalize module


@pytest.mark.parametrize("modules,pooling,message", [
    (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens is not"),
    (["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True,
                                  "pooling_mode_cls_token": True}, "exactly one of"),
    (["Transformer", "Pooling"], {"pooling_mode": "max"}, "pooling_mode='max' is not supported"),
    (["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True, "include_prompt": False},
     "include_prompt=false"),
    (["Transformer", "Pooling", "Dense"], {"pooling_mode_mean_tokens": True},
     "'sentence_transformers.models.Dense' is not supported"),
    (["Transformer", "Normalize"], None, "lists no sentence_transformers.models.Pooling"),
])
def test_modes_and_modules_not_run_are_refused(tmp_path, modules, pooling, message):
    with pytest.raises(ModelFileError, match=message):
        pooler_config(_st_folder(tmp_path, modules, pooling))
