"""Load a Hugging Face tokenizer from an HF directory or from a GGUF file's metadata, offline."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedllm.loader.gguf_loader import gguf_header
from pagedllm.paths import TOKENIZER_MARKER

_FROM_CONFIG = ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length")


def _match_gguf_metadata(tok: PreTrainedTokenizerBase, gguf_path: Path) -> None:
    """Make chat template, bos and eos agree with the GGUF metadata."""
    fields = gguf_header(gguf_path)[0]
    template = fields.get("tokenizer.chat_template")
    if template is not None and tok.chat_template != template:
        tok.chat_template = template
    for attr in ("bos", "eos"):
        token_id = fields.get(f"tokenizer.ggml.{attr}_token_id")
        if token_id is not None and getattr(tok, f"{attr}_token_id") != int(token_id):
            setattr(tok, f"{attr}_token", tok.convert_ids_to_tokens(int(token_id)))


def _load_exported(path: Path) -> PreTrainedTokenizerBase:
    """A tokenizer the model store exported from a GGUF, built straight from its tokenizer.json
    with the special tokens of tokenizer_config.json and the chat template: the same ids,
    template and special tokens as AutoTokenizer gives (tested), in 0.5 s instead of 1.3 s for
    Qwen2's 152k vocabulary (AutoTokenizer parses the file in Python and rebuilds it)."""
    config = json.loads((path / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                  **{k: config[k] for k in _FROM_CONFIG if config.get(k) is not None})
    template = path / "chat_template.jinja"
    if template.is_file():
        tok.chat_template = template.read_text()
    return tok


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer for an HF directory or a .gguf file, never touching the network."""
    path = Path(path).expanduser()
    if path.is_dir() and all((path / n).is_file() for n in (TOKENIZER_MARKER, "tokenizer.json",
                                                              "tokenizer_config.json")):
        return _load_exported(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"tokenizer path={str(path)!r} is neither a directory nor a .gguf file")
    gguf_header(path)  # a truncated or corrupt file is refused here, before transformers reads it
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    _match_gguf_metadata(tok, path)
    return tok
