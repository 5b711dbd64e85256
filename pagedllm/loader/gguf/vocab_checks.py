"""What a GGUF's tokenizer metadata must agree on, refused with a ModelFileError naming the
file and the key.

Two stages:
- check_vocab_header, on the header alone (the arrays' types and lengths, the tensor table):
  before any token string is read, so that a hostile file of 10M tokens is refused in the time
  it takes to walk its header, with the memory of a header;
- check_vocab, on the vocabulary read (merges, the special tokens llama.cpp would fall back on).

llama.cpp's llama-vocab.cpp is the reference: it refuses what is refused here (a token list
that is not an array of strings, scores or token types shorter than the token list, a byte-level
vocabulary without merges, an embedding of another size), and its defaults for absent special
tokens are taken where they mean what they claim (SentencePiece's <s> = 1, </s> = 2).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.header import GGUFArrayInfo, GGUFTensorInfo, gguf_arrays
from pagedllm.loader.gguf.vocab import GGUFVocab

_T = "tokenizer.ggml."
_STRING, _INT32, _FLOAT32 = 8, 5, 6
_INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
# per-token arrays: key -> (element types allowed, what they are called)
_PER_TOKEN = {_T + "scores": (frozenset({_FLOAT32, _INT32}), "float32 (or int32)"),
              _T + "token_type": (_INTEGER_TYPES, "integers")}
# llama.cpp's defaults for a vocabulary without the keys: SentencePiece ('llama') and
# WordPiece ('bert'), taken where the id holds the token they mean
_DEFAULT_IDS = {"llama": {"bos_id": (1, "<s>"), "eos_id": (2, "</s>")},
                "bert": {"bos_id": (101, "[CLS]"), "sep_id": (102, "[SEP]"),
                         "unk_id": (100, "[UNK]"), "pad_id": (0, "[PAD]"),
                         "mask_id": (103, "[MASK]")}}


def _refuse(source: str | Path, problem: str) -> ModelFileError:
    return ModelFileError(f"{source}: {problem}")


def _embedding_rows(fields: Mapping[str, Any], tensors: tuple[GGUFTensorInfo, ...],
                    source: str | Path) -> Optional[tuple[int, str]]:
    """(rows, what) the vocabulary must fit: token_embd.weight's rows, and <arch>.vocab_size
    (which llama.cpp sizes that tensor by) must agree with them; None for a vocabulary-only
    file (no embedding)."""
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    key = f"{fields.get('general.architecture')}.vocab_size"
    declared = fields.get(key)
    if embed is None:
        return None if not isinstance(declared, int) else (declared, key)
    rows = embed.shape[0]
    if declared is not None and declared != rows:
        raise _refuse(source, f"{key}={declared!r} but the embedding token_embd.weight has "
                              f"{rows} rows: they must agree")
    return rows, f"the embedding token_embd.weight's {rows} rows"


def _array_of(arrays: Mapping[str, GGUFArrayInfo], fields: Mapping[str, Any], key: str,
              etypes: frozenset, kind: str, source: str | Path) -> Optional[GGUFArrayInfo]:
    """The array stated for key (None if the key is absent), of one of etypes."""
    if key not in fields:
        return None
    info = arrays.get(key)
    if info is None or info.etype not in etypes:
        got = "a single value" if info is None else f"an array of value type {info.etype}"
        raise _refuse(source, f"{key} must be an array of {kind}, got {got}")
    return info


def check_vocab_header(fields: Mapping[str, Any], arrays: Mapping[str, GGUFArrayInfo],
                       tensors: tuple[GGUFTensorInfo, ...], source: str | Path) -> None:
    """Refuse tokenizer metadata that cannot be the model's, from the header alone: more tokens
    than the embedding has rows, per-token arrays of another length than the token list, merges
    that are not strings. A file with no token list passes (its tokenizer is elsewhere, or it
    is refused when one is built from it)."""
    tokens = _array_of(arrays, fields, _T + "tokens", frozenset({_STRING}), "strings", source)
    if tokens is None:
        return
    n = tokens.length
    limit = _embedding_rows(fields, tensors, source)
    if limit is not None and n > limit[0]:
        raise _refuse(source, f"{_T}tokens has {n} tokens, more than {limit[1]}: ids "
                              f"{limit[0]} to {n - 1} would have no embedding (refused from "
                              "the header, before reading the vocabulary)")
    for key, (etypes, kind) in _PER_TOKEN.items():
        info = _array_of(arrays, fields, key, etypes, kind, source)
        if info is not None and info.length != n:
            raise _refuse(source, f"{key} has {info.length} entries for the {n} tokens of "
                                  f"{_T}tokens: it must have one per token")
    _array_of(arrays, fields, _T + "merges", frozenset({_STRING}), "strings", source)


def check_token_count(path: str | Path, max_tokens: int) -> None:
    """Refuse, from its header, a GGUF tokenizer with more tokens than max_tokens (the
    model's embedding rows, when the tokenizer is another file than the model)."""
    tokens = gguf_arrays(path).get(_T + "tokens")
    if tokens is not None and tokens.length > max_tokens:
        raise _refuse(path, f"{_T}tokens has {tokens.length} tokens, more than the model's "
                            f"embedding has rows ({max_tokens}): it is another model's "
                            "tokenizer (refused from the header, before reading it)")


def _check_merges(vocab: GGUFVocab, source: str | Path) -> None:
    """Each merge is 'left right' (one space), left, right and their join all tokens: what
    the BPE model needs (tokenizers would refuse it without naming the file)."""
    if vocab.merges is None:
        if vocab.model == "gpt2":  # llama.cpp: "cannot find tokenizer merges in model file"
            raise _refuse(source, f"{_T}merges is missing: a byte-level BPE ('gpt2') "
                                  "vocabulary needs its merges")
        return
    known = set(vocab.tokens)
    for i, merge in enumerate(vocab.merges):
        left, _, right = merge.partition(" ")  # faster than split: this runs 150k times
        if not left or not right or " " in right:
            raise _refuse(source, f"{_T}merges[{i}] = {merge!r} is not two tokens separated "
                                  "by one space")
        if left not in known or right not in known or left + right not in known:
            missing = next(t for t in (left, right, left + right) if t not in known)
            raise _refuse(source, f"{_T}merges[{i}] = {merge!r}: {missing!r} is not in "
                                  f"{_T}tokens")


def _with_defaults(vocab: GGUFVocab) -> GGUFVocab:
    """A SentencePiece or WordPiece vocabulary without its special-token keys gets llama.cpp's
    default ids (SentencePiece's <s> 1 and </s> 2; BERT's [CLS] 101, [SEP] 102, ...) where
    those ids hold the tokens the defaults mean; otherwise unchanged."""
    defaults = _DEFAULT_IDS.get(vocab.model, {})
    found = {attr: token_id for attr, (token_id, text) in defaults.items()
             if getattr(vocab, attr) is None and token_id < len(vocab.tokens)
             and vocab.tokens[token_id] == text}
    return dataclasses.replace(vocab, **found) if found else vocab


def _eos_fallback(vocab: GGUFVocab) -> str:
    """What llama.cpp would end generation on without the key, and why that is no end token."""
    fallback = {"gpt2": 11, "llama": 2}.get(vocab.model)
    if fallback is None or fallback >= len(vocab.tokens):
        return f"llama.cpp has no fallback for a {vocab.model!r} vocabulary of this size"
    return f"llama.cpp's fallback, id {fallback}, is {vocab.tokens[fallback]!r}"


def _check_special_tokens(vocab: GGUFVocab, fields: Mapping[str, Any], add_bos: bool,
                          source: str | Path) -> None:
    """Refuse a vocabulary the engine could not use rightly: no token that ends generation,
    or a prompt that must start with a bos token it does not name."""
    # a WordPiece vocabulary is an encoder's: it ends each input with [SEP] and generates nothing
    if vocab.model != "bert" and vocab.eos_id is None and all(fields.get(f"{_T}{k}") is None
                                    for k in ("eot_token_id", "eom_token_id")):
        raise _refuse(source, f"{_T}eos_token_id is missing (and no {_T}eot_token_id or "
                              f"eom_token_id): generation could never stop at an end token "
                              f"({_eos_fallback(vocab)}); add it with gguf-py's "
                              "gguf_new_metadata.py --special-token-by-id eos ID")
    if add_bos and vocab.bos_id is None:
        why = (f"{_T}add_bos_token is true" if vocab.add_bos else
               f"llama.cpp's default for {_T}pre={vocab.pre!r}" if vocab.model == "gpt2" else
               f"llama.cpp's default for {_T}model={vocab.model!r}, whose id "
               f"{_DEFAULT_IDS[vocab.model]['bos_id'][0]} is not "
               f"{_DEFAULT_IDS[vocab.model]['bos_id'][1]}")
        raise _refuse(source, f"{_T}bos_token_id is missing, but prompts must start with it "
                              f"({why}): every prompt would be built wrong")


def check_vocab(vocab: GGUFVocab, fields: Mapping[str, Any], add_bos: bool,
                source: str | Path) -> GGUFVocab:
    """The vocabulary read from source, with llama.cpp's sane defaults applied, or a
    ModelFileError naming the key: malformed merges, no end token, a bos token missing that
    every prompt needs (add_bos: whether the tokenizer adds one)."""
    _check_merges(vocab, source)
    vocab = _with_defaults(vocab)
    _check_special_tokens(vocab, fields, add_bos, source)
    return vocab
