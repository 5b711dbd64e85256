"""SentencePiece GGUF vocabularies built from their metadata (gguf_spm) against transformers'
GGUF tokenizer: Gemma 3 270M's real file, and small llama-arch files with byte fallback."""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.tokenization_utils_base import generate_merges

from pagedllm.tokenizer import gguf_tokenizer_cache
from pagedllm.loader.errors import NotBuildable
from pagedllm.tokenizer.fast_tokenizer import FastTokenizer
from pagedllm.tokenizer.gguf_spm import build_spm_tokenizer, derive_merges, derive_merges_by_position
from pagedllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pagedllm.loader.gguf.vocab import read_gguf_vocab
from pagedllm.tokenizer.hf_tokenizer import wrap_transformers
from pagedllm.tokenizer.known_templates import with_known_template
from pagedllm.tokenizer.tokenizer import load_tokenizer
from pagedllm.tokenizer.files import load_tokenizer_files, save_tokenizer_files

TEXTS = [
    "Hello world",
    " one leading space",
    "  two leading spaces, and trailing   ",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\n\tif x != 0: pass\r\n",
    "naïve café über Ærøskøbing — “quotes” …",
    "中文测试，日本語のテキスト、한국어 문장",
    "emoji 🤗🚀 and a family 👩‍👩‍👧 flag 🇯🇵 and a rare one \U0001fae8",
    "whitespace runs:\t\t\t  \n\n   \u3000 end" + " " * 40 + "x" + "\n" * 40,
    "numbers 0 7 42 2024 123456789 3.14159 1e-10 x²",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos> glued<pad>text <mask> <unk> <unused0> [multimodal]",
    "literal byte token text <0x0A> and \u2581 the space mark",
    "\x00\x01 control bytes \x7f",
    "e\u0301 decomposed vs é composed",
    "",
]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write 2+2 in Python: 中文 🤗"},
        {"role": "assistant", "content": "print(2 + 2)"},
        {"role": "user", "content": "  thanks\n"}]


@dataclass(frozen=True)
class Gemma:
    """Gemma 3's GGUF, the tokenizer built here and transformers' (its template as ours)."""

    path: Path
    built: FastTokenizer
    reference: PreTrainedTokenizerBase


def _reference(path: Path, tmp: Path) -> PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer, from a folder holding only the file."""
    (tmp / path.name).symlink_to(path)
    return AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name, local_files_only=True)


@pytest.fixture(scope="session")
def gemma(gemma_gguf, tmp_path_factory) -> Gemma:
    """Built once: transformers' reference takes ~21 s for Gemma's 262k tokens."""
    reference = _reference(gemma_gguf, tmp_path_factory.mktemp("gemma-gguf"))
    built = tokenizer_from_gguf(gemma_gguf)
    assert isinstance(built, FastTokenizer)  # by gguf_spm, not handed to transformers
    built = with_known_template(built, gemma_gguf)  # the file has none: as load_tokenizer does
    reference.chat_template = built.chat_template
    return Gemma(gemma_gguf, built, reference)


@pytest.mark.parametrize("text", TEXTS)
def test_gemma_ids_match_transformers(gemma, text):
    for special in (True, False):
        assert (gemma.built.encode(text, add_special_tokens=special)
                == gemma.reference(text, add_special_tokens=special).input_ids)


def test_gemma_decode_matches_transformers(gemma):
    for text in TEXTS:
        ids = gemma.reference(text).input_ids
        for skip in (False, True):
            assert (gemma.built.decode(ids, skip_special_tokens=skip)
                    == gemma.reference.decode(ids, skip_special_tokens=skip))
    every_id = list(range(0, len(gemma.reference), 89))
    assert gemma.built.decode(every_id) == gemma.reference.decode(every_id)
    assert gemma.built.convert_ids_to_tokens(every_id) == \
        gemma.reference.convert_ids_to_tokens(every_id)


def test_gemma_tokenizer_is_transformers_one(gemma):
    """The whole Rust tokenizer (model, merges, normalizer, pre-tokenizer, decoder,
    post-processor, added tokens) and the spec transformers' gives."""
    mine = json.loads(gemma.built.backend_tokenizer.to_str())
    theirs = json.loads(gemma.reference.backend_tokenizer.to_str())
    by_id = lambda tokens: sorted(tokens, key=lambda t: t["id"])  # noqa: E731
    assert by_id(mine.pop("added_tokens")) == by_id(theirs.pop("added_tokens"))
    assert mine == theirs
    # wrap_transformers keeps the post-processor as it is rather than naming the flags
    assert replace(gemma.built.spec, add_bos_token=None, add_eos_token=None) == \
        wrap_transformers(gemma.reference).spec
    assert (gemma.built.spec.add_bos_token, gemma.built.spec.add_eos_token) == \
        (gemma.reference.add_bos_token, gemma.reference.add_eos_token) == (True, False)
    assert gemma.built.special_tokens_map == {"bos_token": "<bos>", "eos_token": "<eos>",
                                              "unk_token": "<unk>", "pad_token": "<pad>",
                                              "mask_token": "<mask>"}
    assert gemma.built.all_special_ids == gemma.reference.all_special_ids
    assert gemma.built.encode("hi")[0] == 2  # add_bos_token true in the file


def test_gemma_chat_template_renders_as_transformers(gemma):
    for prompt in (True, False):
        assert (gemma.built.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=False)
                == gemma.reference.apply_chat_template(CHAT, add_generation_prompt=prompt,
                                                       tokenize=False))
        assert (gemma.built.apply_chat_template(CHAT, add_generation_prompt=prompt,
                                                return_dict=False)
                == gemma.reference.apply_chat_template(CHAT, add_generation_prompt=prompt,
                                                       return_dict=False))


def test_gemma_files_load_back_in_pagedllm_and_transformers(gemma, tmp_path):
    """What the cache and the model store keep: the same tokenizer read back fast, and
    transformers reads the folder to the same ids."""
    files = save_tokenizer_files(gemma.built, tmp_path)
    assert files == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    again = load_tokenizer_files(tmp_path)
    assert again.spec == gemma.built.spec
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in TEXTS:
        assert again.encode(text) == gemma.built.encode(text) == theirs(text).input_ids
    assert theirs.apply_chat_template(CHAT, tokenize=False) == \
        gemma.built.apply_chat_template(CHAT, tokenize=False)


# ---- merges ------------------------------------------------------------------------------------

def test_derived_merges_are_transformers_ones():
    """On random vocabularies with tied scores (the stable order matters) and repeated pieces."""
    rng = random.Random(3)
    for _ in range(20):
        tokens = list(dict.fromkeys("".join(rng.choice("ab▁c") for _ in range(rng.randint(1, 5)))
                                    for _ in range(60)))
        scores = [float(rng.randint(-4, 0)) for _ in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        assert derive_merges(tuple(tokens), tuple(scores)) == \
            generate_merges(vocab, dict(zip(tokens, scores)))
        positions = {t: -i for i, t in enumerate(tokens)}
        assert derive_merges_by_position(tuple(tokens)) == generate_merges(vocab, positions)


# ---- llama-arch SentencePiece files ------------------------------------------------------------

def _spm_gguf(path: Path, arch: str = "llama", **flags) -> Path:
    """A small GGUF with a SentencePiece vocabulary: the 256 byte-fallback tokens, pieces with
    scores, a user-defined token; flags: add_space_prefix, merges (a list), add_eos."""
    pieces = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581abc", "ca",
              "\u2581\u2581", "\u2581b"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces + ["<tool>"]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-1.0, -2.0, -3.0, -3.0, -1.5, -1.2, -0.5, -1.2,
                                              -0.7, -2.5, -1.1, -1.6] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(block_count=1, context_length=64, embedding_length=8,
                           feed_forward_length=16, attention__head_count=2).items():
        writer.add_uint32(f"{arch}." + key.replace("__", "."), value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if "add_space_prefix" in flags:
        writer.add_add_space_prefix(flags["add_space_prefix"])
    if "merges" in flags:
        writer.add_token_merges(flags["merges"])
    if "add_eos" in flags:
        writer.add_add_eos_token(flags["add_eos"])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SMALL_TEXTS = ["ab a abc", " ab  bc ", "abc\nca b", "x ñ 🤗 a<tool>b", "<s>ab</s>", "", "   "]


@pytest.mark.parametrize("flags", [{}, {"add_space_prefix": True},
                                   {"merges": ["\u2581 a", "a b", "\u2581a b", "b c", "\u2581ab c"],
                                    "add_eos": True}],
                         ids=["derived-merges", "prefix-flag", "file-merges"])
def test_llama_sentencepiece_matches_transformers(tmp_path, flags):
    path = _spm_gguf(tmp_path / "spm.gguf", **flags)
    built = tokenizer_from_gguf(path)
    assert isinstance(built, FastTokenizer)
    (tmp_path / "ref").mkdir()
    reference = _reference(path, tmp_path / "ref")
    for text in SMALL_TEXTS:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special).input_ids
            assert built.encode(text, add_special_tokens=special) == ids, text
            assert built.decode(ids) == reference.decode(ids)
            assert built.decode(ids, skip_special_tokens=True) == \
                reference.decode(ids, skip_special_tokens=True)
    # letters not in the vocabulary: their UTF-8 bytes, as byte-fallback tokens
    assert built.convert_ids_to_tokens(built.encode("x ñ", add_special_tokens=False)) == \
        ["\u2581", "<0x78>", "\u2581", "<0xC3>", "<0xB1>"]
    mine = json.loads(built.backend_tokenizer.to_str())
    theirs = json.loads(reference.backend_tokenizer.to_str())
    assert mine["model"] == theirs["model"] and mine["decoder"] == theirs["decoder"]
    assert mine["pre_tokenizer"] == theirs["pre_tokenizer"]
    assert built.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.mark.parametrize("arch, flags, reason", [
    ("llama", {"add_space_prefix": False}, "add_space_prefix=False where transformers' "
                                           "LlamaTokenizer adds space prefix"),
    ("gemma3", {}, "add_space_prefix=None where transformers' GemmaTokenizer adds no"),
    ("phi3", {}, "general.architecture 'phi3' has no SentencePiece flavour"),
])
def test_what_transformers_would_build_otherwise_goes_to_it(tmp_path, arch, flags, reason,
                                                            monkeypatch, caplog):
    """Refused here with the reason, then built by transformers and kept like any other."""
    path = _spm_gguf(tmp_path / "spm.gguf", arch=arch, **flags)
    vocab = read_gguf_vocab(path)
    with pytest.raises(NotBuildable, match=reason):
        build_spm_tokenizer(vocab, arch, True, path)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        tok = load_tokenizer(path)
    assert reason.split(" where")[0] in caplog.text and "transformers" in caplog.text
    assert tok.encode("ab")[0] == 1  # <s>: llama.cpp's default for SentencePiece


@pytest.mark.parametrize("changes, reason", [
    ({"token_types": None}, "no tokenizer.ggml.token_type"),
    ({"scores": None}, "neither tokenizer.ggml.merges nor tokenizer.ggml.scores"),
    ({"model": "gpt2"}, "not SentencePiece"),
])
def test_vocabularies_not_built_exactly_are_refused(tmp_path, changes, reason):
    vocab = replace(read_gguf_vocab(_spm_gguf(tmp_path / "spm.gguf")), **changes)
    with pytest.raises(NotBuildable, match=reason):
        build_spm_tokenizer(vocab, "llama", True)


def test_kept_in_the_cache_and_read_back_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = _spm_gguf(tmp_path / "spm.gguf")
    first = load_tokenizer(path)
    monkeypatch.setattr(gguf_tokenizer_cache, "tokenizer_from_gguf",
                        lambda *a, **k: pytest.fail("cached tokenizer was rebuilt"))
    again = load_tokenizer(path)
    assert again.spec == first.spec
    for text in SMALL_TEXTS:
        assert again.encode(text) == first.encode(text)
    assert replace(again.spec, chat_template=None) == replace(first.spec, chat_template=None)
