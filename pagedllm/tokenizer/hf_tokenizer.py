"""Between pagedllm's FastTokenizer and transformers' tokenizers, both ways. transformers is
imported inside these functions only: the engine's own path never calls them for the model
store's tokenizers, and importing transformers costs ~1 s."""
from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from pagedllm.tokenizer.fast_tokenizer import FastTokenizer, TokenizerSpec

# methods whose override in a transformers tokenizer class changes ids or text beyond what its
# Rust tokenizer does (CodeLlama's infilling, CodeGen's truncation patterns)
_BEHAVIOUR = ("__call__", "encode", "_encode_plus", "tokenize", "decode", "_decode",
              "convert_tokens_to_string", "apply_chat_template")


def wrap_transformers(tok: Any) -> FastTokenizer:
    """A FastTokenizer of a transformers tokenizer: a copy of its Rust tokenizer with its
    special tokens, template and decode flags. ValueError if it has no Rust tokenizer (a slow
    tokenizer) or its class changes encoding or decoding in Python."""
    from transformers import TokenizersBackend

    backend = (getattr(tok, "backend_tokenizer", None) if isinstance(tok, TokenizersBackend)
               else None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"tokenizer {type(tok).__name__} is a slow (Python) tokenizer: pagedllm "
                         "needs a fast tokenizer, a tokenizer.json beside the model")
    changed = [m for m in _BEHAVIOUR if getattr(type(tok), m) is not getattr(TokenizersBackend, m)]
    if changed:
        raise ValueError(f"tokenizer class {type(tok).__name__} changes {', '.join(changed)} in "
                         "Python; pagedllm encodes and decodes with the Rust tokenizer alone, so "
                         "its results would differ")
    spec = TokenizerSpec(
        special_tokens=dict(tok.special_tokens_map),
        extra_special_tokens=tuple(str(t) for t in tok.extra_special_tokens),
        chat_template=tok.chat_template,
        clean_up_tokenization_spaces=bool(tok.clean_up_tokenization_spaces),
        clean_up_bpe=bool(getattr(
            tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
        split_special_tokens=bool(tok.split_special_tokens),
        model_max_length=int(tok.model_max_length))
    # a copy: transformers changes its backend's settings per call (truncation, padding)
    return FastTokenizer(Tokenizer.from_str(backend.to_str()), spec, transformers_source=tok)


def to_transformers(tok: FastTokenizer) -> Any:
    """The transformers PreTrainedTokenizerFast of a FastTokenizer: the one it was made from,
    else one built from its Rust tokenizer and spec, as transformers builds it from the files."""
    if tok.transformers_source is not None:
        return tok.transformers_source
    from transformers import PreTrainedTokenizerFast

    spec = tok.spec
    kwargs: dict[str, Any] = dict(spec.special_tokens)
    kwargs.update({k: v for k, v in (("add_bos_token", spec.add_bos_token),
                                     ("add_eos_token", spec.add_eos_token)) if v is not None})
    if spec.extra_special_tokens:
        kwargs["extra_special_tokens"] = list(spec.extra_special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, chat_template=spec.chat_template,
        clean_up_tokenization_spaces=spec.clean_up_tokenization_spaces,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=spec.clean_up_bpe,
        split_special_tokens=spec.split_special_tokens, model_max_length=spec.model_max_length,
        **kwargs)
