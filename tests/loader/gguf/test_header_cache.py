"""The parsed GGUF header kept on disk: the same header as a parse, re-parsed when the file
changes, and a damaged copy is ignored."""
from __future__ import annotations

import os
import shutil

import pytest

from pagedllm.loader.gguf import header as gh


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    gh._cached_header.cache_clear()
    yield tmp_path / "cache" / "gguf-headers"
    gh._cached_header.cache_clear()


def test_a_kept_header_is_the_parsed_one(smollm_gguf, fresh_cache):
    parsed = gh.parse_gguf_file(smollm_gguf)
    assert gh.gguf_header(smollm_gguf) == parsed
    kept = list(fresh_cache.glob("*.json"))
    assert len(kept) == 1
    arrays = gh.gguf_arrays(smollm_gguf)
    assert arrays["tokenizer.ggml.tokens"] == gh.GGUFArrayInfo(etype=8, length=49152)
    gh._cached_header.cache_clear()
    assert gh._read_kept_header(kept[0]) == (*parsed, arrays)
    assert gh.gguf_header(smollm_gguf) == parsed  # now from the kept copy
    assert gh.gguf_arrays(smollm_gguf) == arrays
    fields = gh.gguf_header(smollm_gguf)[0]
    assert all(type(fields[k]) is type(v) for k, v in parsed[0].items())  # bool stays bool


def test_a_changed_file_is_parsed_again(smollm_gguf, fresh_cache, tmp_path):
    copy = tmp_path / "m.gguf"
    shutil.copyfile(smollm_gguf, copy)
    first = gh.gguf_header(copy)
    with open(copy, "r+b") as fh:  # truncate the last tensor: the new parse must refuse it
        fh.truncate(os.path.getsize(copy) - 1)
    gh._cached_header.cache_clear()
    with pytest.raises(gh.ModelFileError, match="truncated"):
        gh.gguf_header(copy)
    assert len(first[1]) > 0


def test_a_damaged_kept_header_is_ignored(smollm_gguf, fresh_cache):
    parsed = gh.gguf_header(smollm_gguf)
    for kept in fresh_cache.glob("*.json"):
        kept.write_text('{"fields": {}, "tensors": [["x", 999, [1], 0, 1]]}')
    gh._cached_header.cache_clear()
    assert gh.gguf_header(smollm_gguf) == parsed
