"""Load a Hugging Face tokenizer from an HF directory or from a GGUF file's metadata, offline."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.loader.gguf_tokenizer_cache import cached_gguf_tokenizer
from pagedllm.loader.tokenizer_files import load_tokenizer_files
from pagedllm.paths import TOKENIZER_MARKER


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer for an HF directory or a .gguf file, never touching the network."""
    path = Path(path).expanduser()
    if path.is_dir() and all((path / n).is_file() for n in (TOKENIZER_MARKER, "tokenizer.json",
                                                              "tokenizer_config.json")):
        return load_tokenizer_files(path)  # exported by the model store
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"tokenizer path={str(path)!r} is neither a directory nor a .gguf file")
    return cached_gguf_tokenizer(path, trust_remote_code=trust_remote_code)
