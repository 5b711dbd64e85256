"""Tokenizing for the HTTP handlers: bounded in size, and off the event loop.

A text prompt longer than max_model_len * chars_per_token characters cannot fit the context
(CharBound), so it is refused before any tokenizing: tokenizing 4 MB of text takes seconds and
690 MB. The tokenizing that remains runs on one worker thread: the event loop keeps answering
meanwhile, and at most one request's tokenizing holds memory at a time.
"""
from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Optional, Sequence, TypeVar

T = TypeVar("T")
# how many characters of the input one character of normalized text may stand for, per
# normalizer; a normalizer missing here may delete characters (StripAccents, BERT's), and a
# tokenizer with one gets no bound
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4,  # composition: at most 4 code points into 1
                      "Prepend": 1, "Lowercase": 1}
# pre-tokenizers that keep every character (Whitespace and BERT's drop the spaces)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


class CharBound(NamedTuple):
    """A lower bound on the tokens of a text, from its length alone."""

    chars_per_token: int  # the most characters one token can stand for
    vanishing: str  # characters the tokenizer drops (no token has their byte): not counted

    def fewest_tokens(self, text: str) -> int:
        """No tokenizing of text gives fewer tokens than this."""
        dropped = sum(text.count(c) for c in self.vanishing)
        return math.ceil((len(text) - dropped) / self.chars_per_token)


def char_bound(tokenizer: Any) -> Optional[CharBound]:
    """The tokenizer's CharBound, or None where it may drop input beyond a few known characters
    (then a text's length bounds nothing). Each kept input character is covered by at least one
    token, and a token covers at most as many characters as its vocabulary string has (a
    byte-level string has one character per byte; a byte-fallback token, '<0xE2>', covers at
    most one), scaled by how far normalizing can shrink the text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    shrink = _shrink(_state(backend.normalizer))
    pre = _types(_state(backend.pre_tokenizer))
    if shrink is None or pre is None or type(backend.model).__name__ != "BPE":
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    vanishing = _vanishing(backend.model, pre, vocab)
    if vanishing is None:
        return None
    return CharBound(shrink * max(len(t) for t in vocab), vanishing)


def _vanishing(model: Any, pre: set[str], vocab: dict[str, int]) -> Optional[str]:
    """The characters BPE drops for want of a token for their bytes, or None where that is more
    than single-byte characters (a missing continuation byte, no byte-level alphabet and no
    complete byte fallback). SmolLM2's vocabulary lacks 6 ASCII control bytes, for one."""
    if "ByteLevel" in pre:
        missing = [b for b, c in enumerate(_BYTE_LEVEL) if c not in vocab]
        if any(0x80 <= b < 0xC0 for b in missing):
            return None
        return "".join(chr(b) for b in missing if b < 0x80)
    if getattr(model, "byte_fallback", False) and all(f"<0x{b:02X}>" in vocab
                                                      for b in range(256)):
        return ""
    return None


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> character map, the one the ByteLevel pre-tokenizer writes bytes in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


_BYTE_LEVEL = _byte_level_chars()


def _state(component: Any) -> Optional[dict[str, Any]]:
    return None if component is None else json.loads(component.__getstate__())


def _shrink(normalizer: Optional[dict[str, Any]]) -> Optional[int]:
    if normalizer is None:
        return 1
    kind = normalizer["type"]
    if kind == "Sequence":
        factors = [_shrink(n) for n in normalizer["normalizers"]]
        return None if None in factors else math.prod(factors)
    if kind == "Replace":  # Llama's ' ' -> '▁': one character for one
        pattern = normalizer["pattern"].get("String")
        return 1 if pattern is not None and len(pattern) <= len(normalizer["content"]) else None
    return _NORMALIZER_SHRINK.get(kind)


def _types(pre: Optional[dict[str, Any]]) -> Optional[set[str]]:
    """The pre-tokenizer's types, or None if one of them may drop characters."""
    if pre is None:
        return set()
    if pre["type"] == "Sequence":
        parts = [_types(p) for p in pre["pretokenizers"]]
        return None if None in parts else set().union(*parts)
    if pre["type"] not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return None
    return {pre["type"]}


class PromptTokens:
    """The handlers' tokenizer: length bounds checked on the event loop, the tokenizing and chat
    template rendering on one worker thread."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.bound = char_bound(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
        self._in_flight = 0  # calls submitted and not yet returned (read from other threads)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the worker thread."""
        self._in_flight += 1  # on the event loop only: no lock needed
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._in_flight -= 1

    def busy(self) -> bool:
        """Whether a prompt is being tokenized or rendered (idle-time work waits for it)."""
        return self._in_flight > 0

    def check_text(self, text: str, field: str) -> None:
        """ValueError naming field for a text too long to fit max_model_len whatever its tokens
        (checked without tokenizing)."""
        if self.bound is None:
            return
        fewest = self.bound.fewest_tokens(text)
        if fewest >= self.max_model_len:
            raise ValueError(
                f"{field} is {len(text)} characters long, so at least {fewest} tokens, but "
                f"max_model_len is {self.max_model_len}: the prompt plus at least one generated "
                "token must fit; shorten the prompt or raise max_model_len")

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        """The engine's length rule for a tokenized prompt (ValueError naming field), checked
        before handing the ids over."""
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{field} is {len(ids)} tokens long but max_model_len is {self.max_model_len}: "
                "the prompt plus at least one generated token must fit; shorten the prompt or "
                "raise max_model_len")

    async def encode(self, texts: Sequence[str], fields: Sequence[str],
                     add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (as the engine tokenizes a text prompt), after check_text."""
        for text, field in zip(texts, fields):
            self.check_text(text, field)
        return await self.run(self._encode, list(texts), add_special_tokens)

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


__all__ = ["CharBound", "PromptTokens", "char_bound"]
