"""Load a Hugging Face tokenizer from an HF directory or from a GGUF file's metadata, offline."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.loader.gguf_loader import gguf_header


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


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer for an HF directory or a .gguf file, never touching the network."""
    path = Path(path).expanduser()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"tokenizer path={str(path)!r} is neither a directory nor a .gguf file")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    _match_gguf_metadata(tok, path)
    return tok
