"""GGUF files with SmolLM2's model (its metadata and tensor table, the data left sparse) and a
tokenizer section chosen by the test, written by gguf's GGUFWriter.

A small byte-level BPE vocabulary (the 256 byte symbols, a few merges, three control tokens)
builds in milliseconds; `extra_tokens` appends that many more tokens to tokenizer.ggml.tokens,
spliced into the written file from numpy (GGUFWriter packs ~300k strings a second, too slow for
the millions a hostile file holds).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Optional

import gguf
import numpy as np
from tokenizers import pre_tokenizers

from pagedllm.loader.gguf.header import gguf_header, read_gguf_header

SYMBOLS = tuple(sorted(pre_tokenizers.ByteLevel.alphabet()))
WORDS = ("Ġa", "Ġab", "12", "123", "ab")
MERGES = ("Ġ a", "Ġa b", "1 2", "12 3", "a b")
CONTROLS = ("<s>", "</s>", "<pad>")
TOKENS = SYMBOLS + WORDS + CONTROLS
BOS, EOS, PAD = (TOKENS.index(t) for t in CONTROLS)
_T = "tokenizer.ggml."
# a small, valid gpt2 tokenizer section; a test drops (None) or replaces keys
TOKENIZER: dict[str, Any] = {
    _T + "model": "gpt2", _T + "pre": "gpt-2", _T + "tokens": list(TOKENS),
    _T + "token_type": [1] * (len(TOKENS) - 3) + [3, 3, 3], _T + "merges": list(MERGES),
    _T + "bos_token_id": BOS, _T + "eos_token_id": EOS, _T + "padding_token_id": PAD,
    _T + "add_bos_token": False,
}
_PLACEHOLDER = "pagedllm-extra-tokens-go"  # 24 bytes: with its length, one 32-byte entry
_FILLER_BYTES = 8  # each extra token: "Z" and 7 digits


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, list):
        kinds = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32}
        sub = kinds.get(type(value[0]), gguf.GGUFValueType.INT32) if value else None
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


def _fillers(count: int) -> bytes:
    """count length-prefixed 8-byte tokens Z0000000, Z0000001, ... as GGUF string entries."""
    entries = np.zeros((count, 8 + _FILLER_BYTES), dtype=np.uint8)
    entries[:, :8] = np.frombuffer(struct.pack("<Q", _FILLER_BYTES), dtype=np.uint8)
    entries[:, 8] = ord("Z")
    ids = np.arange(count, dtype=np.int64)
    for digit in range(7):
        entries[:, 15 - digit] = ord("0") + (ids // 10 ** digit) % 10
    return entries.tobytes()


def _splice_tokens(header: bytes, extra: int) -> bytes:
    """The header with its placeholder token replaced by `extra` filler tokens."""
    key = (_T + "tokens").encode()
    at = header.index(struct.pack("<Q", len(key)) + key + struct.pack("<II", 9, 8))
    count_at = at + 8 + len(key) + 8
    count = struct.unpack_from("<Q", header, count_at)[0]
    entry = struct.pack("<Q", len(_PLACEHOLDER)) + _PLACEHOLDER.encode()
    start = header.index(entry)
    out = bytearray(header[:start] + _fillers(extra) + header[start + len(entry):])
    out[count_at:count_at + 8] = struct.pack("<Q", count - 1 + extra)
    return bytes(out)


def write_gguf(path: Path, model: Path, tokenizer: Optional[dict[str, Any]] = None,
               extra_tokens: int = 0) -> Path:
    """A GGUF at path: model's metadata and tensor table, TOKENIZER updated by `tokenizer` (a
    None value drops the key), and extra_tokens more tokens (even: the tensor data stays
    aligned). The tensor data is a sparse hole of zeros."""
    assert extra_tokens % 2 == 0
    fields, tensors = gguf_header(model)
    section = {**TOKENIZER, **(tokenizer or {})}
    if extra_tokens:
        section[_T + "tokens"] = list(section[_T + "tokens"]) + [_PLACEHOLDER]
    writer = gguf.GGUFWriter(str(path), fields["general.architecture"])
    for key, value in fields.items():
        if key != "general.architecture" and value is not None and not key.startswith("tokenizer."):
            _add(writer, key, value)
    for key, value in section.items():
        if value is not None:
            _add(writer, key, value)
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    if extra_tokens:
        path.write_bytes(_splice_tokens(path.read_bytes(), extra_tokens))
    with open(path, "rb") as fh:
        written = read_gguf_header(fh, path)[1]
    os.truncate(path, max(t.offset + t.nbytes for t in written))
    return path
