"""WordPiece GGUF vocabularies (`tokenizer.ggml.model` "bert", gguf_wpm) on small files written
as llama.cpp's converter writes them, against transformers' BertTokenizerFast over the same
vocab.txt: lower-casing as the file says (llama.cpp's default: none), llama.cpp's default special
ids when the keys are missing, refusals naming the key. The real all-MiniLM vocabulary:
tests/models/test_minilm_gguf.py."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import pytest
from transformers import BertTokenizerFast

from pagedllm.loader.errors import ModelFileError
from pagedllm.tokenizer import gguf_tokenizer_cache
from pagedllm.tokenizer.fast_tokenizer import FastTokenizer
from pagedllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf

# BERT's layout: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103 (llama.cpp's defaults)
SPECIALS = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}
WORDS = ["the", "cat", "cafe", "Cafe", "caf", "##e", "##s", "##é", "sat", "un", "##believ",
         "##able", "!", ",", ".", "'", "t", "don", "a", "b", "中", "##at", "c", "##a", "##t"]
VOCAB = [SPECIALS.get(i, f"[unused{i}]") for i in range(104)] + WORDS
TEXTS = ["the cat sat!", "The CAT sat, unbelievable.", "Café cafés", "don't", "中cat a\tb",
         "zzz unknownword", "[CLS] the [SEP] cat [MASK]", "  ", "cats"]


def _phantom(token: str) -> str:
    """The converter's spelling: control tokens as they are, "##x" -> "x", "x" -> "\u2581x"."""
    return token if token in SPECIALS.values() else \
        token[2:] if token.startswith("##") else "\u2581" + token


def _write(path: Path, lowercase: Optional[bool], special_ids: bool = True,
           tokens: Optional[list[str]] = None) -> Path:
    """A bert GGUF holding only the vocabulary (and an embedding of its size)."""
    tokens = tokens or [_phantom(t) for t in VOCAB]
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if t in SPECIALS.values()
                           else gguf.TokenType.NORMAL) for t in VOCAB])
    if special_ids:  # the converter names them; an older file may not
        for add, i in ((w.add_bos_token_id, 101), (w.add_eos_token_id, 102),
                       (w.add_unk_token_id, 100), (w.add_sep_token_id, 102),
                       (w.add_pad_token_id, 0), (w.add_mask_token_id, 103)):
            add(i)
    if lowercase is not None:
        w.add_key_value("tokenizer.ggml.normalizer.lowercase", lowercase, gguf.GGUFValueType.BOOL)
    w.add_tensor("token_embd.weight", np.zeros((len(VOCAB), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(lowercase: bool) -> BertTokenizerFast:
    return BertTokenizerFast(vocab={t: i for i, t in enumerate(VOCAB)}, do_lower_case=lowercase)


@pytest.mark.parametrize("lowercase", [True, False, None])
def test_ids_match_bert_tokenizer_fast(tmp_path, lowercase):
    ours = tokenizer_from_gguf(_write(tmp_path / "v.gguf", lowercase))
    # llama.cpp: no tokenizer.ggml.normalizer.lowercase key, no lower-casing (nor accent stripping)
    ref = _reference(bool(lowercase))
    assert isinstance(ours, FastTokenizer)
    assert ours.get_vocab() == ref.get_vocab()
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
    assert ours.encode("the") == [101, VOCAB.index("the"), 102]  # [CLS] text [SEP]


def test_special_ids_default_to_llama_cpp_ones(tmp_path):
    # no *_token_id keys: llama.cpp's [CLS] 101, [SEP] 102, [UNK] 100, [PAD] 0, [MASK] 103
    named = tokenizer_from_gguf(_write(tmp_path / "named.gguf", True))
    unnamed = tokenizer_from_gguf(_write(tmp_path / "unnamed.gguf", True, special_ids=False))
    for text in TEXTS:
        assert unnamed.encode(text) == named.encode(text), text
    assert unnamed.special_tokens_map == named.special_tokens_map


def test_default_ids_that_hold_other_tokens_are_refused(tmp_path):
    tokens = [_phantom(t) for t in VOCAB]
    tokens[101] = "[unused101]"  # no [CLS] where llama.cpp's default looks
    with pytest.raises(ModelFileError,
                       match="bos_token_id is missing.*whose id 101 is not \\[CLS\\]"):
        tokenizer_from_gguf(_write(tmp_path / "v.gguf", True, special_ids=False, tokens=tokens))


def test_a_token_spelled_twice_is_refused(tmp_path):
    tokens = [_phantom(t) for t in VOCAB]
    tokens[VOCAB.index("##s")] = "\u2581the"  # would be "the" twice
    with pytest.raises(ModelFileError, match="'the' twice"):
        tokenizer_from_gguf(_write(tmp_path / "v.gguf", True, tokens=tokens))


def test_kept_in_the_cache_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = _write(tmp_path / "v.gguf", True)
    built = gguf_tokenizer_cache.cached_gguf_tokenizer(path)
    assert (gguf_tokenizer_cache.cache_folder(path) / gguf_tokenizer_cache.SOURCE_MARKER).is_file()
    again = gguf_tokenizer_cache.cached_gguf_tokenizer(path)
    for text in TEXTS:
        assert again.encode(text) == built.encode(text)
