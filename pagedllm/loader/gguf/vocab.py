"""Read the tokenizer a GGUF file describes: its `tokenizer.*` metadata, arrays included.

header.py's reader skips arrays (loading weights never needs them); a tokenizer needs
the vocabulary and merges in full. This walks only the metadata section of the file, through a
memory map, and keeps the `tokenizer.*` keys: about 0.3 s for Qwen2's 152k tokens and merges,
where gguf.GGUFReader takes ~10 s (it makes a numpy view per string).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pagedllm.loader.errors import ModelFileError

_GGUF_MAGIC = b"GGUF"
# GGUF value type id -> struct format of one scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MAX_NESTING = 4  # arrays of arrays: none in practice; a hostile file must not recurse deeply


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF, under llama.cpp's meaning of each key."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: Optional[str]  # tokenizer.ggml.pre: the pre-tokenizer llama.cpp applies, e.g. "qwen2"
    tokens: tuple[str, ...]
    token_types: Optional[tuple[int, ...]]  # 1 normal, 2 unknown, 3 control, 4 user-defined, ...
    merges: Optional[tuple[str, ...]]  # "left right", best first
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: Optional[int]
    unk_id: Optional[int]
    add_bos: Optional[bool]  # None: the file does not say
    add_eos: Optional[bool]
    chat_template: Optional[str]
    scores: Optional[tuple[float, ...]] = None  # SentencePiece: each token's log probability
    add_space_prefix: Optional[bool] = None  # SentencePiece: "\u2581" before the text; None: unsaid
    sep_id: Optional[int] = None  # WordPiece ("bert"): the token that ends each sequence
    mask_id: Optional[int] = None
    lowercase: Optional[bool] = None  # WordPiece: tokenizer.ggml.normalizer.lowercase


class _Walker:
    """Bounds-checked little-endian reads from the start of a mapped GGUF."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def _truncated(self, at: int) -> ModelFileError:
        return ModelFileError(f"{self.path}: GGUF metadata is truncated or corrupt "
                          f"(a value at byte {at} runs past the end of the file)")

    def _take(self, n: int) -> int:
        """Advance past n bytes; return where they start."""
        start = self.pos
        if start + n > len(self.buf):
            raise self._truncated(start)
        self.pos = start + n
        return start

    def _check_count(self, count: int, min_size: int) -> None:
        """Fail at once on an element count the rest of the file cannot hold."""
        if count * min_size > len(self.buf) - self.pos:
            raise self._truncated(self.pos)

    def scalar(self, fmt: str) -> Any:
        """One little-endian scalar of struct format fmt."""
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.buf, self._take(size))[0]

    def string(self) -> str:
        """A u64-length-prefixed UTF-8 string."""
        n = self.scalar("Q")
        start = self._take(n)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: GGUF string at byte {start} is not valid UTF-8") from None

    def value(self, vtype: int, keep: bool, depth: int = 0) -> Any:
        """A metadata value; with keep False, arrays are skipped and None returned."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ModelFileError(f"{self.path}: GGUF metadata has unknown value type {vtype} "
                             f"at byte {self.pos - 4}")
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[etype])
            start = self._take(count * size)
            return struct.unpack_from(f"<{count}{_SCALARS[etype]}", self.buf, start) if keep else None
        self._check_count(count, 8 if etype == _STRING else 12)  # u64 length; nested header
        if etype == _STRING:
            return self._strings(count) if keep else self._skip_strings(count)
        if depth >= _MAX_NESTING:
            raise ModelFileError(f"{self.path}: GGUF metadata nests arrays deeper than "
                                 f"{_MAX_NESTING} at byte {self.pos}")
        values = [self.value(etype, keep, depth + 1) for _ in range(count)]  # nested arrays
        return values if keep else None

    def _strings(self, count: int) -> tuple[str, ...]:
        """count strings, decoded, in one tight loop (Gemma 3's 262k tokens: 0.30 s, where a
        call per string took 0.60 s; Zen 3, busy)."""
        unpack, buf, pos, size = _U64.unpack_from, self.buf, self.pos, len(self.buf)
        out = []
        for _ in range(count):
            if pos + 8 > size:
                raise self._truncated(pos)
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise self._truncated(pos)
            try:
                out.append(buf[pos:pos + n].decode("utf-8"))
            except UnicodeDecodeError:
                raise ModelFileError(f"{self.path}: GGUF string at byte {pos} is not valid "
                                     "UTF-8") from None
            pos += n
        self.pos = pos
        return tuple(out)

    def _skip_strings(self, count: int) -> None:
        """Hop over count strings without decoding them."""
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        for _ in range(count):
            if pos + 8 > len(buf):
                raise self._truncated(pos)
            pos += 8 + unpack(buf, pos)[0]
        if pos > len(buf):
            raise self._truncated(self.pos)
        self.pos = pos


def _token_id(fields: dict[str, Any], key: str, n_tokens: int, path: Path) -> Optional[int]:
    """A special token id from the metadata, or None; ModelFileError if it is no token."""
    value = fields.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n_tokens:
        raise ModelFileError(f"{path}: tokenizer.ggml.{key}={value!r} is not a token id "
                             f"(the vocabulary has {n_tokens} tokens)")
    return value


def _array(fields: dict[str, Any], key: str, kind: type, path: Path) -> Optional[tuple]:
    """An array of the metadata, or None; ModelFileError if it holds anything but kind."""
    value = fields.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, tuple) or not all(type(v) is kind for v in value):
        raise ModelFileError(f"{path}: tokenizer.ggml.{key} is not an array of {kind.__name__}")
    return value


def _scores(fields: dict[str, Any], path: Path) -> Optional[tuple[float, ...]]:
    """tokenizer.ggml.scores as floats (llama.cpp also reads int32 ones), or None."""
    value = fields.get("tokenizer.ggml.scores")
    if value is None:
        return None
    if not isinstance(value, tuple) or not all(type(v) in (float, int) for v in value):
        raise ModelFileError(f"{path}: tokenizer.ggml.scores is not an array of numbers")
    return tuple(map(float, value))


def _text(fields: dict[str, Any], key: str, path: Path) -> Optional[str]:
    """A string of the metadata, or None; ModelFileError if it is something else."""
    value = fields.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelFileError(f"{path}: {key} is not a string")
    return value


def _optional_bool(fields: dict[str, Any], key: str) -> Optional[bool]:
    value = fields.get(key)
    return None if value is None else bool(value)


def read_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """Every `tokenizer.*` metadata key of a GGUF with its value (arrays as tuples)."""
    path = Path(path)
    if path.stat().st_size < 24:  # magic, version and two counts; mmap refuses empty files
        raise ModelFileError(f"{path} is not a GGUF file (too short)")
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        walker = _Walker(buf, path)
        if buf[:4] != _GGUF_MAGIC:
            raise ModelFileError(f"{path} is not a GGUF file (bad magic)")
        walker.pos = 4
        version = walker.scalar("I")
        if version not in (2, 3):
            raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        walker.scalar("Q")  # tensor count: the tensor table is not needed here
        fields: dict[str, Any] = {}
        for _ in range(walker.scalar("Q")):
            key = walker.string()
            keep = key.startswith("tokenizer.")
            value = walker.value(walker.scalar("I"), keep)
            if keep:
                fields[key] = value
        return fields


def read_gguf_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file; ModelFileError if it has none or is corrupt."""
    path = Path(path)
    fields = read_tokenizer_fields(path)
    tokens = _array(fields, "tokens", str, path)
    model = fields.get("tokenizer.ggml.model")
    if not tokens or not isinstance(model, str):
        missing = " and ".join(k for k, v in (("tokenizer.ggml.model", isinstance(model, str)),
                                              ("tokenizer.ggml.tokens", bool(tokens))) if not v)
        raise ModelFileError(f"{path} has no tokenizer in its metadata ({missing}: missing or "
                             "empty; tokenizer.ggml.model and tokenizer.ggml.tokens are required)")
    types = _array(fields, "token_type", int, path)
    merges = _array(fields, "merges", str, path)
    n = len(tokens)
    return GGUFVocab(
        model=model, pre=_text(fields, "tokenizer.ggml.pre", path), tokens=tokens, token_types=types,
        merges=merges,
        bos_id=_token_id(fields, "bos_token_id", n, path),
        eos_id=_token_id(fields, "eos_token_id", n, path),
        pad_id=_token_id(fields, "padding_token_id", n, path),
        unk_id=_token_id(fields, "unknown_token_id", n, path),
        add_bos=_optional_bool(fields, "tokenizer.ggml.add_bos_token"),
        add_eos=_optional_bool(fields, "tokenizer.ggml.add_eos_token"),
        chat_template=_text(fields, "tokenizer.chat_template", path),
        scores=_scores(fields, path),
        add_space_prefix=_optional_bool(fields, "tokenizer.ggml.add_space_prefix"),
        sep_id=_token_id(fields, "seperator_token_id", n, path),  # llama.cpp's spelling
        mask_id=_token_id(fields, "mask_token_id", n, path),
        lowercase=_optional_bool(fields, "tokenizer.ggml.normalizer.lowercase"))
