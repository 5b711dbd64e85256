"""A BERT checkpoint directory written as llama.cpp's convert_hf_to_gguf.py writes it
(conversion/bert.py of the llama.cpp in llama-cpp-python 0.3.36): the `bert` architecture's keys
and tensor names, the WordPiece vocabulary in phantom-space form, the pooling from
1_Pooling/config.json. The suite cannot run the converter (it is not a dependency); the gguf
package writes the same file (checked against the converter's f32 and f16 output by hand: the
same tensors, bytes and keys)."""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

import gguf
import numpy as np
from safetensors.numpy import load_file

# llama.cpp's LLAMA_POOLING_TYPE: mean 1, cls 2, last 3
POOLING_TYPES = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2,
                 "pooling_mode_lasttoken": 3}
_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
          "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
          "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
          "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
_GLOBAL = {"embeddings.word_embeddings.weight": "token_embd.weight",
           "embeddings.position_embeddings.weight": "position_embd.weight",
           "embeddings.token_type_embeddings.weight": "token_types.weight",
           "embeddings.LayerNorm.weight": "token_embd_norm.weight",
           "embeddings.LayerNorm.bias": "token_embd_norm.bias"}
# the converter keeps these matrices in float32 whatever --outtype says
_ALWAYS_F32 = ("position_embd.weight", "token_types.weight")


def gguf_name(hf: str) -> str | None:
    """The converter's name for a BertModel tensor (None: it drops it)."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    if not hf.startswith("encoder.layer."):
        return None  # pooler.*, embeddings.position_ids
    layer, rest = hf.removeprefix("encoder.layer.").split(".", 1)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _vocab(hf_dir: Path) -> tuple[list[str], list[int]]:
    """vocab.txt in phantom-space form, and each token's type (control: the special tokens)."""
    tokens = (hf_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    control = {t["content"] for t in tok_json["added_tokens"] if t["special"]}
    types, spelled = [], []
    for tok in tokens:
        kind = gguf.TokenType.CONTROL if tok in control else gguf.TokenType.NORMAL
        types.append(int(kind))
        spelled.append(tok if tok in control else
                       tok[2:] if tok.startswith("##") else "\u2581" + tok)
    return spelled, types


def write_bert_gguf(hf_dir: Path, out: Path, outtype: str = "f32",
                    pooling_type: Optional[int] = None,
                    extra_tensors: Mapping[str, np.ndarray] = MappingProxyType({})) -> Path:
    """hf_dir (a BertModel with sentence-transformers files) as out, its matrices in outtype
    ("f32" or "f16"), as `convert_hf_to_gguf.py hf_dir --outtype outtype` writes it;
    pooling_type (llama.cpp's number) instead of 1_Pooling's, extra_tensors added."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    if pooling_type is None:
        pooling = json.loads((hf_dir / "1_Pooling" / "config.json").read_text())
        pooling_type = next(v for k, v in POOLING_TYPES.items() if pooling.get(k))
    tokenizer_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_file_type(0 if outtype == "f32" else 1)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling_type))
    tokens, types = _vocab(hf_dir)
    w.add_token_type_count(cfg.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("jina-v2-en")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(101)
    w.add_eos_token_id(102)
    w.add_unk_token_id(100)
    w.add_sep_token_id(102)
    w.add_pad_token_id(0)
    w.add_mask_token_id(103)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(False)
    w.add_key_value("tokenizer.ggml.normalizer.lowercase",
                    bool(tokenizer_cfg.get("do_lower_case")), gguf.GGUFValueType.BOOL)
    for hf, arr in load_file(str(hf_dir / "model.safetensors")).items():
        name = gguf_name(hf)
        if name is None:
            continue
        as_f16 = outtype == "f16" and arr.ndim == 2 and name not in _ALWAYS_F32
        w.add_tensor(name, np.ascontiguousarray(arr, np.float16 if as_f16 else np.float32))
    for name, arr in extra_tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
