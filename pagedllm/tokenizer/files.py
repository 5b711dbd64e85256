"""A tokenizer as files in a folder (tokenizer.json, tokenizer_config.json, chat_template.jinja):
write them (from a FastTokenizer or a transformers tokenizer), and read them back fast as a
FastTokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pagedllm.tokenizer.fast_tokenizer import (NO_MAX_LENGTH, SPECIAL_TOKEN_NAMES, FastTokenizer,
                                            TokenizerSpec)

_CONFIG = "tokenizer_config.json"
_TEMPLATE = "chat_template.jinja"
# a text the saved and reloaded tokenizers must agree on, special tokens included
_PROBE = "Hello, world! 123 \u00e9\u4e2d\U0001f600\n\t  x"


def _token_text(value: Any, key: str) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken dict."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if not isinstance(value, str):
        raise ValueError(f"{_CONFIG}: {key} must be a string or an AddedToken, got {value!r}")
    return value


def _special_tokens(config: dict[str, Any], backend: Tokenizer) -> dict[str, str]:
    """The named special tokens, then model-specific ones (any other *_token with a text), in
    the order transformers keeps them; pad_token defaults to tokenizer.json's padding token."""
    tokens = {k: _token_text(config[k], k) for k in SPECIAL_TOKEN_NAMES
              if config.get(k) is not None}
    if "pad_token" not in tokens and backend.padding:
        tokens = {**tokens, "pad_token": backend.padding["pad_token"]}
        tokens = {k: tokens[k] for k in SPECIAL_TOKEN_NAMES if k in tokens}
    for key, value in config.items():
        if key.endswith("_token") and key not in SPECIAL_TOKEN_NAMES and isinstance(value, str):
            tokens[key] = value
    named = config.get("extra_special_tokens")
    if isinstance(named, dict):  # model-specific tokens by name, as transformers 5 writes them
        tokens.update({k: _token_text(v, k) for k, v in named.items()})
    return tokens


def spec_from_config(config: dict[str, Any], backend: Tokenizer, template: Any) -> TokenizerSpec:
    """What transformers reads from tokenizer_config.json, as a TokenizerSpec."""
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or ()
    if isinstance(extra, dict):  # named: model-specific special tokens, taken above
        extra = ()
    if isinstance(template, list):  # several named templates, as older configs store them
        template = {t["name"]: t["template"] for t in template}
    flags = {k: config.get(k) for k in ("add_bos_token", "add_eos_token")}
    return TokenizerSpec(
        special_tokens=_special_tokens(config, backend),
        extra_special_tokens=tuple(_token_text(t, "extra_special_tokens") for t in extra),
        chat_template=template,
        add_bos_token=None if flags["add_bos_token"] is None else bool(flags["add_bos_token"]),
        add_eos_token=None if flags["add_eos_token"] is None else bool(flags["add_eos_token"]),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        clean_up_bpe=bool(config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
        split_special_tokens=bool(config.get("split_special_tokens", False)),
        model_max_length=int(config.get("model_max_length") or NO_MAX_LENGTH))


def load_tokenizer_files(folder: str | Path) -> FastTokenizer:
    """The tokenizer saved in folder, built straight from its tokenizer.json with
    tokenizer_config.json's special tokens and the chat template: the ids, template and special
    tokens AutoTokenizer gives (tested), in ~0.35 s for Qwen2's 152k vocabulary and without
    importing transformers."""
    folder = Path(folder)
    config = json.loads((folder / _CONFIG).read_text())
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    template_file = folder / _TEMPLATE
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    return FastTokenizer(backend, spec_from_config(config, backend, template))


def _fingerprint(tok: Any) -> tuple:
    """What a reloaded tokenizer must reproduce (of a FastTokenizer or a transformers one)."""
    specials = [tok.convert_ids_to_tokens(i) for i in (tok.bos_token_id, tok.eos_token_id)
                if i is not None]
    probe = _PROBE + "".join(specials)
    return (tok.chat_template, tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token,
            len(tok), tok.encode(probe), tok.encode(probe, add_special_tokens=False),
            {i: (str(t), t.special) for i, t in tok.added_tokens_decoder.items()})


def _config_of(spec: TokenizerSpec) -> dict[str, Any]:
    """tokenizer_config.json for spec, as spec_from_config reads it back (and as transformers
    reads it: its TokenizersBackend over tokenizer.json, with these special tokens)."""
    config: dict[str, Any] = {
        **spec.special_tokens, "tokenizer_class": "TokenizersBackend", "backend": "tokenizers",
        "clean_up_tokenization_spaces": spec.clean_up_tokenization_spaces,
        "split_special_tokens": spec.split_special_tokens,
        "model_max_length": spec.model_max_length}
    for flag in ("add_bos_token", "add_eos_token"):  # unset: tokenizer.json's post-processor
        if getattr(spec, flag) is not None:
            config[flag] = getattr(spec, flag)
    if spec.clean_up_bpe:
        config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    if spec.extra_special_tokens:
        config["extra_special_tokens"] = list(spec.extra_special_tokens)
    if isinstance(spec.chat_template, dict):  # named templates, as transformers stores them
        config["chat_template"] = [{"name": k, "template": v} for k, v in spec.chat_template.items()]
    return config


def _write_fast_tokenizer(tok: FastTokenizer, folder: Path) -> None:
    """Write a FastTokenizer's files (its Rust tokenizer as serialized, its spec as the config),
    then check that the config reads back to the same spec: RuntimeError if not."""
    tok.backend_tokenizer.save(str(folder / "tokenizer.json"), pretty=False)
    (folder / _CONFIG).write_text(json.dumps(_config_of(tok.spec), indent=2, sort_keys=True) + "\n")
    if isinstance(tok.spec.chat_template, str):
        (folder / _TEMPLATE).write_text(tok.spec.chat_template)
    config = json.loads((folder / _CONFIG).read_text())
    template_file = folder / _TEMPLATE
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if spec_from_config(config, tok.backend_tokenizer, template) != tok.spec:
        raise RuntimeError(f"the tokenizer config saved in {folder} does not read back the same "
                           "(special tokens, flags or chat template differ)")


def save_tokenizer_files(tok: Any, folder: str | Path) -> list[str]:
    """Write a tokenizer's files into folder and check that they load back to the same
    tokenizer; return the file names. A FastTokenizer is written as it is (its tokenizer.json
    is the Rust tokenizer's own serialization; the config is checked), a transformers one by
    save_pretrained and reloaded whole. RuntimeError if they do not load back the same."""
    folder = Path(folder)
    if isinstance(tok, FastTokenizer):
        _write_fast_tokenizer(tok, folder)
        return sorted(p.name for p in folder.iterdir())
    tok.save_pretrained(str(folder))
    config_path = folder / _CONFIG
    config = json.loads(config_path.read_text())
    # transformers keeps these in the post-processor only; record them so a reload has them
    config.update(add_bos_token=bool(getattr(tok, "add_bos_token", False)),
                  add_eos_token=bool(getattr(tok, "add_eos_token", False)))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if _fingerprint(load_tokenizer_files(folder)) != _fingerprint(tok):
        raise RuntimeError(f"the tokenizer saved in {folder} does not load back the same "
                           "(ids, special tokens or chat template differ)")
    return sorted(p.name for p in folder.iterdir())
