"""The tokenizer of a GGUF given by path, built once and kept as files in the cache.

    cache_dir()/tokenizers/<path key>-<file key>/
        tokenizer.json, tokenizer_config.json, chat_template.jinja
        .gguf-source.json    what it was built from; written last, so a folder without it is
                             never used

<path key> hashes the file's resolved path, <file key> its size and mtime plus the builder's
version: a changed file gets a new folder (the old one of the same path is removed), and the
file is never read whole to be recognised.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from pagedllm.paths import cache_dir
from pagedllm.tokenizer.fast_tokenizer import FastTokenizer
from pagedllm.tokenizer.files import load_tokenizer_files, save_tokenizer_files
from pagedllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pagedllm.tokenizer.hf_tokenizer import wrap_transformers

logger = logging.getLogger("pagedllm")

# bump when gguf_tokenizer builds differently, so folders built by older code are not used
BUILD_VERSION = 3  # 2: SentencePiece vocabularies built by gguf_spm; 3: WordPiece, gguf_wpm
SOURCE_MARKER = ".gguf-source.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_folder(gguf_path: str | Path) -> Path:
    """Where the tokenizer of this GGUF, as it is now on disk, is (or would be) kept."""
    path = Path(gguf_path).resolve()
    st = path.stat()
    # transformers' version: its GGUF converter makes the tokenizers this module does not
    # (read from the package metadata: importing transformers takes ~1 s)
    version = importlib.metadata.version("transformers")
    identity = f"{st.st_size}\0{st.st_mtime_ns}\0{BUILD_VERSION}\0{version}"
    return cache_dir() / "tokenizers" / f"{_digest(str(path))}-{_digest(identity)}"


def _load_cached(folder: Path) -> Optional[FastTokenizer]:
    """The tokenizer kept in folder; None if there is none or it cannot be read (then dropped)."""
    if not (folder / SOURCE_MARKER).is_file():
        return None
    try:
        return load_tokenizer_files(folder)
    except Exception as exc:  # a damaged cache must not stop a start: rebuild instead
        logger.warning("cached tokenizer in %s is unreadable (%s); building it again", folder, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _store(tok: Any, gguf_path: Path, folder: Path) -> None:
    """Write tok's files into folder atomically, then drop older folders of the same path."""
    scratch = cache_dir() / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=scratch, prefix="tokenizer-"))
    try:
        files = save_tokenizer_files(tok, tmp)
        st = gguf_path.stat()
        (tmp / SOURCE_MARKER).write_text(json.dumps({
            "gguf": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "build_version": BUILD_VERSION, "files": files}))
        folder.parent.mkdir(parents=True, exist_ok=True)
        if folder.exists() and not (folder / SOURCE_MARKER).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # damaged or half-removed: replace it
        try:
            os.rename(tmp, folder)
        except OSError:  # another process stored it first: theirs is as good
            return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    path_key = folder.name.split("-")[0]
    for old in folder.parent.glob(f"{path_key}-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def cached_gguf_tokenizer(gguf_path: str | Path, *, trust_remote_code: bool = False
                          ) -> FastTokenizer:
    """The tokenizer of a GGUF file: from the cache when this file's is kept there (without
    importing transformers), else built from its metadata (gguf_tokenizer; transformers only
    for the kinds it does not build itself) and kept for the next start."""
    path = Path(gguf_path).resolve()
    folder = cache_folder(path)
    cached = _load_cached(folder)
    if cached is not None:
        return cached
    tok = tokenizer_from_gguf(path, trust_remote_code=trust_remote_code)
    try:
        _store(tok, path, folder)
    except (OSError, RuntimeError) as exc:  # a read-only cache, or files that do not reload
        logger.warning("could not keep the tokenizer of %s in %s (%s); it will be built "
                       "again on the next start", path, folder, exc)
    if isinstance(tok, FastTokenizer):
        # built without transformers and written as it is (save_tokenizer_files checked its
        # config reads back the same): reading its tokenizer.json again would cost ~1 s
        return tok
    # the kept files, read as every later start reads them; the built one if they are not kept
    kept = _load_cached(folder)
    return kept if kept is not None else wrap_transformers(tok)
