"""A Qwen2-7B-shaped GGUF of random blocks (the shapes of the real Qwen2-7B-Instruct config in
tests/data), written one tensor at a time: the Q2_K file is ~2.8 GB, never all in memory."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedllm.hub.model_store import ensure_gguf, ensure_model

QWEN7B_CONFIG = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes" / "config.json"
QWEN = "qwen2.5-coder-0.5b-instruct"  # its vocabulary and tokenizer files, through the model store

# fp16 fields of a block: (byte offset, value); d and dmin chosen so weights are ~zero-mean and
# small, so 28 random layers keep activations finite
_HALVES = {T.Q2_K: [(80, 1e-3), (82, 1.5e-3)], T.Q3_K: [(108, 1e-3)], T.Q4_K: [(0, 1e-3), (2, 8e-3)],
           T.Q6_K: [(208, 1e-5)]}


def _random_blocks(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
    """[rows, row_bytes] of random qtype blocks with sane fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.frombuffer(rng.bytes(rows * cols // block * size), dtype=np.uint8).copy()
    blocks = raw.reshape(-1, size)
    for offset, value in _HALVES[qtype]:
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def _tensors(cfg: dict, qtype: T, head_type: T) -> list[tuple[str, tuple[int, int], T | None]]:
    """(GGUF name, (rows, cols), block type or None for float32) in llama.cpp's order."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = [("token_embd.weight", (cfg["vocab_size"], h), qtype)]
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (1, h), None),
                (p + "attn_q.weight", (h, h), qtype), (p + "attn_q.bias", (1, h), None),
                (p + "attn_k.weight", (kv, h), qtype), (p + "attn_k.bias", (1, kv), None),
                (p + "attn_v.weight", (kv, h), qtype), (p + "attn_v.bias", (1, kv), None),
                (p + "attn_output.weight", (h, h), qtype), (p + "ffn_norm.weight", (1, h), None),
                (p + "ffn_gate.weight", (inter, h), qtype), (p + "ffn_up.weight", (inter, h), qtype),
                (p + "ffn_down.weight", (h, inter), qtype)]
    out += [("output_norm.weight", (1, h), None), ("output.weight", (cfg["vocab_size"], h), head_type)]
    return out


def _add_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The shipped Qwen GGUF's tokenizer keys, its tokens padded to vocab_size as Qwen2-7B's
    own GGUF pads them (so llama.cpp runs the file too)."""
    shipped = ensure_gguf(QWEN)
    fields = gguf.GGUFReader(str(shipped)).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in fields["tokenizer.ggml.token_type"].data]
    pad = vocab_size - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode())
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.USER_DEFINED] * pad)
    writer.add_token_merges([bytes(fields["tokenizer.ggml.merges"].parts[i]).decode()
                             for i in fields["tokenizer.ggml.merges"].data])
    for key, add in (("eos", writer.add_eos_token_id), ("bos", writer.add_bos_token_id),
                     ("padding", writer.add_pad_token_id)):
        add(int(fields[f"tokenizer.ggml.{key}_token_id"].parts[-1][0]))


def _float_tensor(name: str, cols: int) -> np.ndarray:
    return (np.ones if name.endswith("norm.weight") else np.zeros)(cols, dtype=np.float32)


def write_qwen7b_gguf(path: Path, qtype: T = T.Q2_K, head_type: T = T.Q6_K, seed: int = 0) -> None:
    """The GGUF at path, with the shipped Qwen tokenizer files beside it."""
    cfg = json.loads(QWEN7B_CONFIG.read_text())
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    _add_vocab(writer, cfg["vocab_size"])
    tensors = _tensors(cfg, qtype, head_type)
    for name, (rows, cols), qt in tensors:
        if qt is None:
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            block, size = GGML_QUANT_SIZES[qt]
            nbytes = rows * cols // block * size
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, (rows, cols), qt in tensors:
        data = _float_tensor(name, cols) if qt is None else _random_blocks(rng, qt, rows, cols)
        writer.write_tensor_data(data)
        del data
    writer.close()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_model(QWEN) / name, path.parent / name)


def drop_regrouped_copies(path: Path) -> None:
    """Remove the x8 copies the engine regrouped from the GGUF at `path` (the next load writes
    them anew)."""
    from pagedllm.worker.x8_weight_file import cache_path

    shutil.rmtree(cache_path(path).parent, ignore_errors=True)


@contextlib.contextmanager
def temporary_qwen7b_q4_k(directory: Path) -> Iterator[Path]:
    """The 7B-shaped 4-bit GGUF (Q4_K blocks, Q6_K head: ~4.4 GB, random) in `directory`; it,
    the directory and its regrouped x8 copies are removed after."""
    path = directory / "qwen2-7b-random-q4_k.gguf"
    write_qwen7b_gguf(path, qtype=T.Q4_K, head_type=T.Q6_K)
    try:
        yield path
    finally:
        drop_regrouped_copies(path)
        shutil.rmtree(path.parent, ignore_errors=True)
