"""Hostile and inconsistent GGUF tokenizers (SmolLM2's model, a tokenizer section written by
gguf's GGUFWriter): each refused with a ModelFileError naming the file and the key, before the
model is planned; a token list far larger than the embedding is refused from the header, fast
and without reading its strings."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from hostile_gguf import BOS, EOS, TOKENS, write_gguf
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.errors import ModelFileError
from pagedllm.tokenizer.gguf_tokenizer import build_tokenizer
from pagedllm.loader.gguf.vocab import read_gguf_vocab
from pagedllm.tokenizer.tokenizer import load_tokenizer

T = "tokenizer.ggml."
EXTRA = 1_000_000  # hostile tokens: read as strings, ~90 MB


@pytest.fixture
def write(smollm_gguf, tmp_path, monkeypatch) -> Callable[..., Path]:
    """write(name, tokenizer changes, extra_tokens) -> a GGUF alone in its folder (no
    tokenizer files beside it), with an empty cache."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))

    def make(name: str, changes: dict[str, Any], extra_tokens: int = 0) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        return write_gguf(folder / f"{name}.gguf", smollm_gguf, changes, extra_tokens)
    return make


# The engine's first step (resolve_checkpoint: the header and the architecture) and the
# tokenizer's (load_tokenizer, as `tokenizer=file.gguf` or a GGUF alone in its folder).
ENTRY_POINTS = {"engine": resolve_checkpoint, "tokenizer": load_tokenizer}

_MEASURE = """
import json, sys, time
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.vocab import read_gguf_vocab
from pagedllm.tokenizer.tokenizer import load_tokenizer

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))

def grown(call):
    # the peak resident memory during call, above what was resident before it (writing 5 to
    # clear_refs resets the peak, VmHWM, to the current resident size)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before, started = status("VmRSS"), time.monotonic()
    try:
        value, error = call(), None
    except ModelFileError as err:
        value, error = None, str(err)
    return value, {"error": error, "grew": status("VmHWM") - before, "s": time.monotonic() - started}

path, out = sys.argv[1], {}
for name, load in (("engine", resolve_checkpoint), ("tokenizer", load_tokenizer)):
    out[name] = grown(lambda: load(path))[1]
vocab, out["read"] = grown(lambda: read_gguf_vocab(path))  # the control: reading the strings
out["read"]["tokens"] = len(vocab.tokens)
print(json.dumps(out))
"""


def test_a_token_list_far_larger_than_the_embedding_is_refused_from_the_header(write, tmp_path):
    """1M tokens for 49152 embedding rows: both entry points refuse it naming the key, the
    embedding and the file, with a few MB of memory; reading the strings (the control) costs
    far more, so the bound would catch a refusal that came after reading them."""
    path = write("huge", {}, extra_tokens=EXTRA)
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parents[3])  # this pagedllm
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    print(json.dumps(out, indent=1))
    bound = 32 * 2**20
    assert out["read"]["tokens"] == len(TOKENS) + EXTRA and out["read"]["grew"] > 2 * bound
    for name in ENTRY_POINTS:
        error = out[name]["error"]
        assert error is not None and str(path) in error, name
        assert f"{T}tokens has {len(TOKENS) + EXTRA} tokens" in error
        assert "token_embd.weight's 49152 rows" in error
        assert out[name]["grew"] < bound, (name, out[name])


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("changes, message", [
    ({T + "token_type": [1] * 10}, rf"{T}token_type has 10 entries for the {len(TOKENS)} tokens"),
    ({T + "scores": [0.0] * (len(TOKENS) + 3)},
     rf"{T}scores has {len(TOKENS) + 3} entries for the {len(TOKENS)} tokens"),
    ({T + "token_type": ["normal"] * len(TOKENS)},
     rf"{T}token_type must be an array of integers, got an array of value type 8"),
    ({T + "tokens": "a"}, rf"{T}tokens must be an array of strings, got a single value"),
    ({T + "merges": [1, 2]}, rf"{T}merges must be an array of strings"),
    ({"llama.vocab_size": 50000}, r"llama.vocab_size=50000 but the embedding token_embd.weight "
                                  r"has 49152 rows"),
])
def test_inconsistent_arrays_are_refused_naming_key_and_file(write, entry, changes, message):
    path = write("bad", changes)
    with pytest.raises(ModelFileError, match=message) as info:
        ENTRY_POINTS[entry](path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("merges, message", [
    (["Ġ a", "a b c"], rf"{T}merges\[1\] = 'a b c' is not two tokens separated by one space"),
    (["ab"], rf"{T}merges\[0\] = 'ab' is not two tokens"),
    (["a  b"], rf"{T}merges\[0\] = 'a  b' is not two tokens"),
    (["Ġ a", "x y"], rf"{T}merges\[1\] = 'x y': 'xy' is not in {T}tokens"),
    (["b a"], rf"{T}merges\[0\] = 'b a': 'ba' is not in {T}tokens"),
    (["\u2603 a"], rf"{T}merges\[0\] = '\u2603 a': '\u2603' is not in {T}tokens"),
    (None, rf"{T}merges is missing: a byte-level BPE \('gpt2'\) vocabulary needs its merges"),
])
def test_garbage_merges_are_refused_naming_the_merge_and_file(write, merges, message):
    path = write("merges", {T + "merges": merges})
    with pytest.raises(ModelFileError, match=message) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_missing_eos_is_refused_generation_could_not_stop(write):
    path = write("no-eos", {T + "eos_token_id": None})
    with pytest.raises(ModelFileError, match=rf"{T}eos_token_id is missing .*generation could "
                                             rf"never stop at an end token \(llama.cpp's "
                                             rf"fallback, id 11, is {TOKENS[11]!r}\)") as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_missing_eos_with_an_end_of_turn_token_loads(write):
    """llama.cpp ends generation on eot and eom too: with one of them, eos may be absent."""
    path = write("eot", {T + "eos_token_id": None, T + "eot_token_id": EOS})
    tok = load_tokenizer(path)
    assert tok.eos_token_id is None and tok.encode("ab") == [TOKENS.index("ab")]
    assert resolve_checkpoint(path).arch.eos_token_ids == (EOS,)


def test_missing_bos_is_refused_only_where_prompts_start_with_it(write):
    path = write("add-bos", {T + "bos_token_id": None, T + "add_bos_token": True})
    with pytest.raises(ModelFileError, match=rf"{T}bos_token_id is missing, but prompts must "
                                             rf"start with it \({T}add_bos_token is true\)"
                                             ) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)
    # llama-bpe's default is to add bos (llama.cpp's too): refused without the flag as well
    path = write("llama-bpe", {T + "bos_token_id": None, T + "add_bos_token": None,
                               T + "pre": "llama-bpe"})
    with pytest.raises(ModelFileError, match=rf"llama.cpp's default for {T}pre='llama-bpe'"):
        load_tokenizer(path)
    # a vocabulary that never adds bos does not need one
    tok = load_tokenizer(write("no-bos", {T + "bos_token_id": None}))
    assert tok.bos_token_id is None and tok.encode("ab") == [TOKENS.index("ab")]


SPM_TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
SPM = {T + "model": "llama", T + "pre": None, T + "merges": None, T + "tokens": SPM_TOKENS,
       T + "scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -1.2, -0.5],
       T + "token_type": [2, 3, 3, 1, 1, 1, 1, 1, 1], T + "padding_token_id": None,
       T + "add_bos_token": None}


def test_sentencepiece_without_bos_eos_takes_llama_cpp_defaults(write):
    """llama.cpp's SentencePiece defaults (bos 1, eos 2) are taken where those ids are <s> and
    </s>: prompts start with <s> and generation ends at </s>."""
    tok = load_tokenizer(write("spm", {**SPM, T + "bos_token_id": None, T + "eos_token_id": None}))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("ab")[0] == 1


def test_sentencepiece_without_a_bos_that_is_s_is_refused(write):
    tokens = ["<unk>", "x", "</s>"] + SPM_TOKENS[3:]
    path = write("spm-x", {**SPM, T + "tokens": tokens, T + "bos_token_id": None,
                           T + "eos_token_id": 2})
    with pytest.raises(ModelFileError, match=rf"{T}bos_token_id is missing, but prompts must "
                                             rf"start with it \(llama.cpp's default for "
                                             rf"{T}model='llama', whose id 1 is not <s>\)"):
        load_tokenizer(path)


def test_a_consistent_hostile_free_file_still_loads(write):
    """The small vocabulary as written (the control of the cases above) builds and agrees."""
    path = write("good", {})
    tok = load_tokenizer(path)
    assert len(tok) == len(TOKENS) and tok.eos_token_id == EOS and tok.bos_token_id == BOS
    assert tok.encode(" ab 123") == [TOKENS.index("Ġab"), TOKENS.index("Ġ"), TOKENS.index("123")]
    assert resolve_checkpoint(path).arch.vocab_size == 49152


def test_another_models_gguf_tokenizer_is_refused_from_its_header(qwen_gguf, tmp_path, monkeypatch):
    """tokenizer=qwen.gguf for SmolLM2 (49152 rows): refused before Qwen's 151936 tokens are
    read or built (nothing is kept in the tokenizer cache)."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelFileError, match=rf"{T}tokens has 151936 tokens, more than the "
                                             r"model's embedding has rows \(49152\)") as info:
        load_tokenizer(qwen_gguf, max_tokens=49152)
    assert str(qwen_gguf) in str(info.value)
    assert not (tmp_path / "cache" / "tokenizers").exists()


def test_transformers_errors_name_the_file_and_the_key(write):
    """A tokenizer model neither built here nor known to transformers' converter."""
    path = write("rwkv", {T + "model": "rwkv"})
    with pytest.raises(ModelFileError, match=rf"the tokenizer could not be built from "
                                             rf"{T}model='rwkv' \(through transformers' GGUF "
                                             r"converter\): ValueError: Cannot build") as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_tokenizers_errors_name_the_file_and_the_keys(write):
    """The tokenizers library's own refusal (a merge of tokens it does not know, which
    check_vocab would have refused first), re-raised naming the file and the keys."""
    path = write("good", {})
    vocab = read_gguf_vocab(path)
    vocab = dataclasses.replace(vocab, merges=vocab.merges + ("x y",))
    with pytest.raises(ModelFileError, match=rf"{path}: the tokenizer could not be built from "
                                             rf"{T}tokens and {T}merges: Exception: .*Token `xy` out of vocabulary"):
        build_tokenizer(vocab, path)


@pytest.mark.parametrize("key", ["model", "tokens"])
def test_a_missing_required_key_is_named(write, key):
    path = write(f"no-{key}", {T + key: None})
    with pytest.raises(ModelFileError, match=rf"has no tokenizer in its metadata \({T}{key}: "
                                             "missing") as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)
