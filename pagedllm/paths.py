"""Where pagedllm keeps files on disk: one cache root, one folder per kind of file.

    $PAGEDLLM_CACHE_DIR (default ~/.cache/pagedllm)
      models/<name>/     a shipped model's GGUF, its exported tokenizer and TOKENIZER_MARKER
      tmp/               scratch on the cache's filesystem, so renames stay atomic
      locks/             one lock file per model, held while it is fetched
      kernels/<key>/     the compiled CPU kernels, one folder per build key
      hub-headers/       header-only stubs of hub checkpoints (never inside the HF cache)
      tokenizers/<key>/  the tokenizer of a GGUF given by path, built once from its metadata
"""
from __future__ import annotations

import os
import pathlib

TOKENIZER_MARKER = ".tokenizer-export.json"  # in a model folder: names a finished tokenizer export


def cache_dir() -> pathlib.Path:
    """Root of the cache: $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm."""
    env = os.environ.get("PAGEDLLM_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "pagedllm"


def hub_headers_dir() -> pathlib.Path:
    """Where header-only stubs of hub checkpoints live (their tensor data is not there by design)."""
    return cache_dir() / "hub-headers"
