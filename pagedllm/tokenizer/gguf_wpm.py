"""The WordPiece tokenizer of a BERT GGUF (`tokenizer.ggml.model` "bert"), built as
transformers' BertTokenizerFast is: the same ids for the same text.

llama.cpp's converter writes the vocabulary in "phantom space" form: a word-start token gets a
"\u2581" before it ("\u2581cat"), a continuation loses its "##" ("##s" -> "s"), control
tokens ([CLS], [SEP], ...) stay as they are. That is undone here, token by token, and the
tokenizers library's WordPiece runs over it with BERT's normalizer (lower-casing and accent
stripping as `tokenizer.ggml.normalizer.lowercase` says; llama.cpp's default: neither) and
pre-tokenizer. Every input is [CLS] text [SEP], as llama.cpp and BertTokenizerFast make it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors

from pagedllm.loader.errors import ModelFileError, building_tokenizer
from pagedllm.loader.gguf.vocab import GGUFVocab
from pagedllm.tokenizer.fast_tokenizer import SPECIAL_TOKEN_NAMES, FastTokenizer, TokenizerSpec
from pagedllm.tokenizer.gguf_spm import CONTROL, USER_DEFINED

_PHANTOM = "\u2581"
_CONTINUATION = "##"  # BERT's continuing-subword prefix
# BertTokenizer's max_input_chars_per_word: a longer word is [UNK]
_MAX_WORD_CHARS = 100


def _wordpiece_tokens(vocab: GGUFVocab) -> list[str]:
    """The vocabulary as BERT's vocab.txt spells it."""
    types = vocab.token_types or (0,) * len(vocab.tokens)
    spelled = []
    for token, kind in zip(vocab.tokens, types):
        if kind == CONTROL:
            spelled.append(token)
        elif token.startswith(_PHANTOM):
            spelled.append(token[len(_PHANTOM):])
        else:
            spelled.append(_CONTINUATION + token)
    return spelled


def _special_ids(vocab: GGUFVocab, source: str | Path) -> dict[str, Optional[int]]:
    """BertTokenizerFast's named special tokens by id ([CLS] is llama.cpp's bos, [SEP] its
    separator, else its eos); check_vocab has given llama.cpp's defaults where keys lack."""
    ids = {"unk_token": vocab.unk_id, "sep_token": vocab.sep_id or vocab.eos_id,
           "pad_token": vocab.pad_id, "cls_token": vocab.bos_id, "mask_token": vocab.mask_id}
    for name, key in (("cls_token", "bos_token_id"), ("sep_token", "seperator_token_id"),
                      ("unk_token", "unknown_token_id")):
        if ids[name] is None:
            raise ModelFileError(f"{source}: tokenizer.ggml.{key} is missing and llama.cpp's "
                                 f"default id does not hold BERT's {name}: a WordPiece "
                                 "vocabulary needs it")
    return ids


def _backend(vocab: GGUFVocab, spelled: list[str], ids: dict[str, Optional[int]],
             source: str | Path) -> Tokenizer:
    """WordPiece with BERT's normalizer, pre-tokenizer, [CLS] ... [SEP] and decoder."""
    lowercase = bool(vocab.lowercase)
    cls, sep = spelled[ids["cls_token"]], spelled[ids["sep_token"]]
    with building_tokenizer(source, "tokenizer.ggml.tokens (a WordPiece vocabulary)"):
        backend = Tokenizer(models.WordPiece(
            {t: i for i, t in enumerate(spelled)}, unk_token=spelled[ids["unk_token"]],
            continuing_subword_prefix=_CONTINUATION, max_input_chars_per_word=_MAX_WORD_CHARS))
        backend.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lowercase,
            lowercase=lowercase)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix=_CONTINUATION, cleanup=True)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, ids["cls_token"]), (sep, ids["sep_token"])])
    types = vocab.token_types or ()
    with building_tokenizer(source, "tokenizer.ggml.token_type"):
        backend.add_special_tokens([AddedToken(spelled[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == CONTROL])
        backend.add_tokens([AddedToken(spelled[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == USER_DEFINED])
    return backend


def build_wpm_tokenizer(vocab: GGUFVocab, source: str | Path = "the GGUF vocabulary"
                        ) -> FastTokenizer:
    """The tokenizer of a WordPiece GGUF vocabulary (checked by check_vocab); ModelFileError
    naming source and the keys where it cannot be BERT's."""
    if vocab.model != "bert":
        raise ValueError(f"tokenizer.ggml.model is {vocab.model!r}, not WordPiece ('bert')")
    spelled = _wordpiece_tokens(vocab)
    seen: set[str] = set()
    twice = next((t for t in spelled if t in seen or seen.add(t)), None)
    if twice is not None:
        raise ModelFileError(f"{source}: tokenizer.ggml.tokens holds {twice!r} twice once "
                             "its phantom-space spelling is undone: not a BERT vocabulary")
    ids = _special_ids(vocab, source)
    backend = _backend(vocab, spelled, ids, source)
    specials = {name: spelled[ids[name]] for name in SPECIAL_TOKEN_NAMES
                if ids.get(name) is not None}
    spec = TokenizerSpec(special_tokens=specials, clean_up_tokenization_spaces=True)
    with building_tokenizer(source, "the special tokens (tokenizer.ggml.*_token_id)"):
        return FastTokenizer(backend, spec)
