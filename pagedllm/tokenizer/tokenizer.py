"""Load the engine's tokenizer from an HF directory or a GGUF file's metadata, offline."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pagedllm.loader.gguf.vocab_checks import check_token_count
from pagedllm.paths import TOKENIZER_MARKER
from pagedllm.tokenizer.fast_tokenizer import FastTokenizer
from pagedllm.tokenizer.files import load_tokenizer_files
from pagedllm.tokenizer.gguf_tokenizer_cache import cached_gguf_tokenizer
from pagedllm.tokenizer.hf_tokenizer import wrap_transformers
from pagedllm.tokenizer.known_templates import with_known_template


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False,
                   max_tokens: Optional[int] = None) -> FastTokenizer:
    """Tokenizer for an HF directory or a .gguf file, never touching the network. The model
    store's exported folders and cached GGUF tokenizers load without transformers; any other
    directory goes through AutoTokenizer (wrapped; ValueError for a slow tokenizer). A .gguf
    with more tokens than max_tokens (the model's embedding rows) is refused from its header.
    A GGUF's tokenizer without a chat template gets its vocabulary's known one
    (known_templates)."""
    path = Path(path).expanduser()
    if path.is_dir() and all((path / n).is_file() for n in (TOKENIZER_MARKER, "tokenizer.json",
                                                              "tokenizer_config.json")):
        # exported by the model store from its GGUF
        return with_known_template(load_tokenizer_files(path), path)
    if path.is_dir():
        from transformers import AutoTokenizer  # ~1 s to import: only for such directories

        return wrap_transformers(AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=trust_remote_code))
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"tokenizer path={str(path)!r} is neither a directory nor a .gguf file")
    if max_tokens is not None:
        check_token_count(path, max_tokens)
    return with_known_template(cached_gguf_tokenizer(path, trust_remote_code=trust_remote_code),
                               path)
