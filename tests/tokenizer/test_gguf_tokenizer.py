"""The tokenizer built from a GGUF's metadata against transformers' GGUF tokenizer on the real
shipped models, the cases it leaves to transformers, and the per-file cache."""
from __future__ import annotations

import copy
import logging
import os
import random
import shutil
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.tokenizer import gguf_tokenizer_cache
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.header import gguf_header
from pagedllm.tokenizer.gguf_tokenizer import NotBuildable, build_tokenizer, tokenizer_from_gguf
from pagedllm.tokenizer.gguf_tokenizer_cache import SOURCE_MARKER, cache_folder, cached_gguf_tokenizer
from pagedllm.loader.gguf.vocab import GGUFVocab, read_gguf_vocab
from pagedllm.tokenizer.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "  two leading spaces, and trailing   ",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\n\tif x != 0: pass\r\n",
    "naïve café über Ærøskøbing — “quotes” …",
    "中文测试，日本語のテキスト、한국어 문장",
    "emoji 🤗🚀 and a family 👩‍👩‍👧 flag 🇯🇵",
    "whitespace runs:\t\t\t  \n\n   \u3000 end",
    "numbers 0 7 42 2024 123456789 3.14159 1e-10 x²",
    "I'm sure you'LL see THEY'RE we'd",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> glued<|im_end|>text",
    "<tool_call>{\"name\": \"f\"}</tool_call> <|fim_prefix|>x<|fim_suffix|>",
    "e\u0301 decomposed vs é composed",
    "",
]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write 2+2 in Python: 中文 🤗"},
        {"role": "assistant", "content": "print(2 + 2)"},
        {"role": "user", "content": "<|im_start|>thanks"}]
SPECIALS = {"bos_token": "bos_id", "eos_token": "eos_id", "pad_token": "pad_id", "unk_token": "unk_id"}


@dataclass(frozen=True)
class Case:
    """One shipped model: its GGUF, the tokenizer built here, and transformers' reference."""

    path: Path
    vocab: GGUFVocab
    built: PreTrainedTokenizerBase
    reference: PreTrainedTokenizerBase


@pytest.fixture(scope="session", params=["qwen", "smollm"])
def case(request, qwen_gguf, smollm_gguf, tmp_path_factory) -> Case:
    """Built once per session: transformers' reference takes ~10 s for Qwen's vocabulary."""
    path = {"qwen": qwen_gguf, "smollm": smollm_gguf}[request.param]
    alone = tmp_path_factory.mktemp(f"{request.param}-gguf")  # no exported files beside it
    (alone / path.name).symlink_to(path)
    reference = AutoTokenizer.from_pretrained(str(alone), gguf_file=path.name, local_files_only=True)
    vocab = read_gguf_vocab(path)
    return Case(path, vocab, build_tokenizer(vocab), reference)


def test_reader_matches_gguf_reader(smollm_gguf):
    """The vocabulary reader against llama.cpp's own Python reader."""
    reader = gguf.GGUFReader(str(smollm_gguf))
    vocab = read_gguf_vocab(smollm_gguf)
    field = reader.fields
    assert list(vocab.tokens) == field["tokenizer.ggml.tokens"].contents()
    assert list(vocab.merges) == field["tokenizer.ggml.merges"].contents()
    assert list(vocab.token_types) == field["tokenizer.ggml.token_type"].contents()
    assert (vocab.model, vocab.pre) == ("gpt2", "smollm")
    assert (vocab.bos_id, vocab.eos_id, vocab.pad_id, vocab.unk_id) == (1, 2, 2, 0)
    assert (vocab.add_bos, vocab.add_eos) == (False, None)
    assert vocab.chat_template == field["tokenizer.chat_template"].contents()


@pytest.mark.parametrize("cut", [30, 1_000, 200_000, 600_000, 1_200_000, 1_700_000])
def test_reader_refuses_a_cut_file_by_name(smollm_gguf, tmp_path, cut):
    """Cuts in the preamble, the vocabulary, the token types and the merges."""
    path = tmp_path / "cut.gguf"
    with open(smollm_gguf, "rb") as fh:
        path.write_bytes(fh.read(cut))
    with pytest.raises(ModelFileError, match="truncated or corrupt") as info:
        read_gguf_vocab(path)
    assert str(path) in str(info.value)


def test_mutated_headers_read_or_raise_model_file_error(tmp_path):
    """Seeded fuzzing: bytes, hostile counts and lengths, and cuts in a small GGUF's metadata
    give a vocabulary or a ModelFileError, never another exception."""
    path = _sentencepiece_gguf(tmp_path / "seed.gguf")
    clean = path.read_bytes()
    rng, outcomes = random.Random(7), {"read": 0, "refused": 0}
    for case in range(300):
        data = bytearray(clean)
        at, kind = rng.randrange(24, len(clean) - 8), rng.choice(("bytes", "u64", "u32", "cut"))
        if kind == "bytes":
            data[at] = rng.randrange(256)
        elif kind == "cut":
            data = data[:at]
        else:
            nasty = rng.choice((0, 1, 9, 255, 2**31, 2**32 - 1, 2**63, 2**64 - 1))
            fmt = "<Q" if kind == "u64" else "<I"
            data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, nasty % 2 ** (8 * struct.calcsize(fmt)))
        path.write_bytes(bytes(data))
        try:
            read_gguf_vocab(path)
            outcomes["read"] += 1
        except ModelFileError:
            outcomes["refused"] += 1
        except Exception as err:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case} ({kind} at {at}): {type(err).__name__}: {err}")
    assert outcomes["refused"] >= 100 and outcomes["read"] >= 10, outcomes


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(case, text):
    for special in (True, False):
        assert (case.built(text, add_special_tokens=special).input_ids
                == case.reference(text, add_special_tokens=special).input_ids)


def test_decode_matches_transformers(case):
    for text in TEXTS:
        ids = case.reference(text).input_ids
        for skip in (False, True):
            assert (case.built.decode(ids, skip_special_tokens=skip)
                    == case.reference.decode(ids, skip_special_tokens=skip))
    every_id = list(range(0, len(case.vocab.tokens), 97))
    assert case.built.decode(every_id) == case.reference.decode(every_id)
    assert case.built.convert_ids_to_tokens(every_id) == case.reference.convert_ids_to_tokens(every_id)


def test_vocabulary_and_added_tokens_match_transformers(case):
    assert case.built.get_vocab() == case.reference.get_vocab()
    assert len(case.built) == len(case.reference) == len(case.vocab.tokens)
    added = {i: (str(t), t.special, t.normalized) for i, t in case.built.added_tokens_decoder.items()}
    assert added == {i: (str(t), t.special, t.normalized)
                     for i, t in case.reference.added_tokens_decoder.items()}


def test_special_tokens_follow_the_metadata(case):
    """bos/eos/pad/unk are the GGUF's ids; transformers drops some of them for a llama-arch
    file (SmolLM2: all four), so where it has none the metadata is the reference."""
    fields = gguf_header(case.path)[0]
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}
    named = set()
    for attr, key in keys.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        assert getattr(case.built, f"{attr}_id") == token_id, attr
        if token_id is not None:
            named.add(token_id)
            assert getattr(case.built, attr) == case.vocab.tokens[token_id]
        if getattr(case.reference, attr) is not None:
            assert getattr(case.built, attr) == getattr(case.reference, attr), attr
    assert set(case.built.all_special_ids) == set(case.reference.all_special_ids) | named
    assert case.built.add_bos_token is False and case.built.add_eos_token is False


def test_chat_template_matches(case):
    template = gguf_header(case.path)[0]["tokenizer.chat_template"]
    assert case.built.chat_template == template
    reference = case.reference
    if reference.chat_template is None:  # transformers leaves SmolLM2's out
        reference = copy.deepcopy(case.reference)
        reference.chat_template = template
    assert reference.chat_template == template
    for prompt in (True, False):
        assert (case.built.apply_chat_template(CHAT, add_generation_prompt=prompt)
                == reference.apply_chat_template(CHAT, add_generation_prompt=prompt))


def test_smollm_cuts_every_numeral_alone_as_llama_cpp_does(smollm_gguf):
    """llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's tokenizer.json) cut each \\p{N} out
    before the GPT-2 regex, so a space before '½' stays its own token; transformers' GGUF
    converter knows no 'smollm' and would give ' ½' one token pair ['Ġ½'...]."""
    tok = build_tokenizer(read_gguf_vocab(smollm_gguf))
    pieces = tok.convert_ids_to_tokens(tok(" ½ ٣ 42").input_ids)
    assert pieces[:2] == ["Ġ", "Â½"] and pieces[-3:] == ["Ġ", "4", "2"]


# ---- the kinds left to transformers, on small vocabularies -------------------------------------

def _byte_vocab(**changes) -> GGUFVocab:
    """A byte-level vocabulary: the 256 byte symbols, a few merges, three control tokens."""
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ("Ġ a", "Ġa b", "1 2", "12 3", "a b")
    tokens = tuple(symbols) + ("Ġa", "Ġab", "12", "123", "ab", "<s>", "</s>", "<pad>")
    types = (1,) * (len(tokens) - 3) + (3, 3, 3)
    vocab = GGUFVocab(model="gpt2", pre="gpt-2", tokens=tokens, token_types=types, merges=merges,
                      bos_id=len(tokens) - 3, eos_id=len(tokens) - 2, pad_id=len(tokens) - 1,
                      unk_id=None, add_bos=None, add_eos=None, chat_template=None)
    return replace(vocab, **changes)


@pytest.mark.parametrize("changes, reason", [
    ({"model": "llama"}, "tokenizer.ggml.model is 'llama'"),
    ({"pre": "default"}, "tokenizer.ggml.pre 'default'"),
    ({"pre": None}, "tokenizer.ggml.pre None"),
    ({"merges": None}, "no tokenizer.ggml.merges"),
    ({"merges": ("Ġ a b",)}, "merge 'Ġ a b'"),
])
def test_kinds_not_built_exactly_are_refused(changes, reason):
    with pytest.raises(NotBuildable, match=reason):
        build_tokenizer(_byte_vocab(**changes))


def test_tokens_outside_the_byte_alphabet_are_refused():
    vocab = _byte_vocab()
    with pytest.raises(NotBuildable, match=r"token 3 'a b' is not spelled"):
        build_tokenizer(replace(vocab, tokens=vocab.tokens[:3] + ("a b",) + vocab.tokens[4:]))
    with pytest.raises(NotBuildable, match="twice"):
        build_tokenizer(replace(vocab, tokens=vocab.tokens[:3] + vocab.tokens[:1] + vocab.tokens[4:]))


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["a", "Ġ12345", "Ġab"]),
    ("qwen2", ["a", "Ġ", "1", "2", "3", "4", "5", "Ġab"]),
    ("llama-bpe", ["a", "Ġ", "123", "45", "Ġab"]),
    ("smollm", ["a", "Ġ", "1", "2", "3", "4", "5", "Ġab"]),
])
def test_pre_tokenizer_follows_tokenizer_ggml_pre(pre, pieces):
    backend = build_tokenizer(_byte_vocab(pre=pre)).backend_tokenizer
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("a 12345 ab")] == pieces


def test_add_bos_follows_the_flag_then_llama_cpp_default():
    bos = _byte_vocab().bos_id
    assert build_tokenizer(_byte_vocab(pre="llama-bpe"))("ab").input_ids[0] == bos  # llama.cpp: on
    assert build_tokenizer(_byte_vocab(pre="qwen2"))("ab").input_ids[0] != bos
    tok = build_tokenizer(_byte_vocab(pre="llama-bpe", add_bos=False, add_eos=True))
    assert tok("ab").input_ids[0] != bos and tok("ab").input_ids[-1] == _byte_vocab().eos_id


def _sentencepiece_gguf(path: Path, bos_id: int = 1) -> Path:
    """A tiny llama-arch GGUF with a SentencePiece ('llama') vocabulary."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=8,
                           feed_forward_length=16, attention__head_count=2).items():
        writer.add_uint32("llama." + key.replace("__", "."), value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"])
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -1.2, -0.5])
    writer.add_token_types([2, 3, 3, 1, 1, 1, 1, 1, 1])
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((9, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_special_token_id_outside_the_vocabulary_is_refused_by_name(tmp_path):
    path = _sentencepiece_gguf(tmp_path / "bad.gguf", bos_id=9)
    with pytest.raises(ModelFileError, match=r"bos_token_id=9 is not a token id \(the vocabulary "
                                              r"has 9 tokens\)") as info:
        read_gguf_vocab(path)
    assert str(path) in str(info.value)


def test_sentencepiece_is_built_here_and_kept(tmp_path, monkeypatch, caplog):
    """A llama-arch SentencePiece file: built by gguf_spm (no transformers, no fallback line);
    tests/tokenizer/test_gguf_spm.py checks it against transformers."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = _sentencepiece_gguf(tmp_path / "spm.gguf")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        tok = load_tokenizer(path)
    assert "transformers' GGUF tokenizer instead" not in caplog.text
    assert tok.convert_ids_to_tokens(tok.encode("ab a ab")) == ["<s>", "▁ab", "▁a", "▁ab"]
    assert tok.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    # kept like a built one: the second load reads the files and agrees
    monkeypatch.setattr(gguf_tokenizer_cache, "tokenizer_from_gguf",
                        lambda *a, **k: pytest.fail("cached tokenizer was rebuilt"))
    again = load_tokenizer(path)
    assert again.encode("ab a ab") == tok.encode("ab a ab") and again.encode("ab")[0] == 1  # <s>


# ---- the cache ---------------------------------------------------------------------------------

@pytest.fixture
def gguf_copy(smollm_gguf, tmp_path, monkeypatch) -> Path:
    """A copy of SmolLM2's GGUF (its mtime is changed by tests) and an empty cache."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "models" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(smollm_gguf, copy)
    return copy


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Paths the cache sent to the builder, in order."""
    calls: list[Path] = []

    def counting(path, **kwargs):
        calls.append(Path(path))
        return tokenizer_from_gguf(path, **kwargs)

    monkeypatch.setattr(gguf_tokenizer_cache, "tokenizer_from_gguf", counting)
    return calls


def test_second_load_reads_the_cache(gguf_copy, builds):
    first = load_tokenizer(gguf_copy)
    folder = cache_folder(gguf_copy)
    assert {p.name for p in folder.iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                  "chat_template.jinja", SOURCE_MARKER}
    assert builds == [gguf_copy.resolve()]
    second = load_tokenizer(gguf_copy)
    assert builds == [gguf_copy.resolve()]  # not built again
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)
    assert second.chat_template == first.chat_template
    assert second.all_special_ids == first.all_special_ids
    assert second.apply_chat_template(CHAT) == first.apply_chat_template(CHAT)


def test_changed_file_is_built_again(gguf_copy, builds):
    load_tokenizer(gguf_copy)
    old = cache_folder(gguf_copy)
    st = gguf_copy.stat()
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_folder(gguf_copy) != old
    load_tokenizer(gguf_copy)
    assert len(builds) == 2
    assert cache_folder(gguf_copy).is_dir() and not old.exists()  # the stale one is dropped


def test_damaged_cache_is_rebuilt(gguf_copy, builds, caplog):
    load_tokenizer(gguf_copy)
    (cache_folder(gguf_copy) / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        tok = load_tokenizer(gguf_copy)
    assert len(builds) == 2 and "unreadable" in caplog.text
    assert tok.encode("<|im_start|>hi")[0] == 1
    load_tokenizer(gguf_copy)
    assert len(builds) == 2  # the rebuilt one is kept


def test_folder_without_marker_is_not_used(gguf_copy, builds):
    cached_gguf_tokenizer(gguf_copy)
    (cache_folder(gguf_copy) / SOURCE_MARKER).unlink()
    cached_gguf_tokenizer(gguf_copy)
    assert len(builds) == 2
    assert (cache_folder(gguf_copy) / SOURCE_MARKER).is_file()  # replaced by a whole one
    cached_gguf_tokenizer(gguf_copy)
    assert len(builds) == 2
