"""A SentencePiece (`tokenizer.ggml.model` "llama") GGUF vocabulary built from its metadata into
a FastTokenizer, without transformers.

transformers' GGUF converter turns such a vocabulary into a BPE model with byte fallback
(<0xNN> tokens) over the file's tokens, with the merges of the file or, where it has none (Gemma),
merges derived from the vocabulary; then the class of the architecture (GemmaTokenizer,
LlamaTokenizer) brings its normalizer, pre-tokenizer and decoder. This builds the same thing
with the `tokenizers` library directly: ~2 s for Gemma 3's 262k tokens where transformers takes
~21 s (its merge derivation and a Python pass per token). What transformers does differently per
architecture is one Flavour; an architecture without one, or a file whose flags say what its
flavour does not do (add_space_prefix), goes to transformers (NotBuildable).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pagedllm.loader.errors import NotBuildable, building_tokenizer
from pagedllm.tokenizer.fast_tokenizer import SPECIAL_TOKEN_NAMES, FastTokenizer, TokenizerSpec
from pagedllm.loader.gguf.vocab import GGUFVocab

SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4


@dataclass(frozen=True)
class Flavour:
    """What the transformers tokenizer class of one architecture adds to the BPE model."""

    name: str  # the transformers class it reproduces
    prefix_space: bool  # Metaspace puts "\u2581" before the first word (Llama); Gemma: none
    respell_spaces: bool  # a token of only spaces is stored as spaces, looked up as "\u2581"s
    merges_by_position: bool  # derived merges ordered by the tokens' order, not their scores
    bpe_unk: Optional[str]  # the BPE model's unk_token
    defaults: tuple[tuple[str, str], ...] = ()  # special tokens the class names by default

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        """The class's pre-tokenizer."""
        if self.prefix_space:
            return pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        return pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)

    def normalizer(self) -> Optional[normalizers.Normalizer]:
        """The class's normalizer: spaces become "\u2581" (Gemma), or none (Metaspace does it)."""
        return None if self.prefix_space else normalizers.Replace(" ", SPACE)

    def decoder(self) -> decoders.Decoder:
        """"\u2581" back to spaces, <0xNN> tokens to their bytes, and the prefix space off."""
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if self.prefix_space:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        return decoders.Sequence(steps)


_GEMMA = Flavour("GemmaTokenizer", prefix_space=False, respell_spaces=True,
                 merges_by_position=True, bpe_unk="<unk>", defaults=(("mask_token", "<mask>"),))
_LLAMA = Flavour("LlamaTokenizer", prefix_space=True, respell_spaces=False,
                 merges_by_position=False, bpe_unk=None)
# general.architecture -> the flavour transformers' AutoTokenizer gives its SentencePiece GGUF
FLAVOURS: dict[str, Flavour] = {"gemma": _GEMMA, "gemma2": _GEMMA, "gemma3": _GEMMA,
                                "llama": _LLAMA}


def derive_merges(tokens: tuple[str, ...], order: tuple[float, ...]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies, best first, as transformers' generate_merges makes
    them: every split of a token into two tokens, ranked by the token's order value (higher
    first), then by the longer left part."""
    known = set(tokens)
    ranked = []
    for token, value in zip(tokens, order):
        for cut in range(1, len(token)):  # one entry per cut: the keys below never tie in a token
            left = token[:cut]
            if left in known:
                right = token[cut:]
                if right in known:
                    ranked.append((value, cut, len(token) - cut, left, right))
    # a stable sort, reversed as transformers sorts (equal keys keep the order above)
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in ranked]


def derive_merges_by_position(tokens: tuple[str, ...]) -> list[tuple[str, str]]:
    """derive_merges with each token's order value minus its index (Gemma's), without the
    sort: the tokens in their order, each cut from the longest left part down (~4x faster)."""
    known = set(tokens)
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left = token[:cut]
            if left in known:
                right = token[cut:]
                if right in known:
                    merges.append((left, right))
    return merges


def _flavour(vocab: GGUFVocab, architecture: Optional[str]) -> Flavour:
    """The flavour of this vocabulary, or NotBuildable saying why it is left to transformers."""
    flavour = FLAVOURS.get(architecture or "")
    if flavour is None:
        raise NotBuildable(f"general.architecture {architecture!r} has no SentencePiece "
                           f"flavour here (built: {', '.join(sorted(FLAVOURS))})")
    # llama.cpp puts a space before the text unless add_space_prefix is false
    if (vocab.add_space_prefix is not False) != flavour.prefix_space:
        raise NotBuildable(f"tokenizer.ggml.add_space_prefix={vocab.add_space_prefix} where "
                           f"transformers' {flavour.name} "
                           f"{'adds' if flavour.prefix_space else 'adds no'} space prefix")
    if vocab.token_types is None:
        raise NotBuildable("the file has no tokenizer.ggml.token_type")
    if vocab.merges is None and vocab.scores is None and not flavour.merges_by_position:
        raise NotBuildable("the file has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    if len(set(vocab.tokens)) != len(vocab.tokens):
        raise NotBuildable("the vocabulary holds a token twice")
    return flavour


def _spelled(vocab: GGUFVocab, flavour: Flavour) -> tuple[str, ...]:
    """The tokens as the BPE model looks them up (Gemma's runs of spaces as "\u2581"s)."""
    if not flavour.respell_spaces:
        return vocab.tokens
    spelled = tuple(SPACE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens)
    if len(set(spelled)) != len(spelled):
        raise NotBuildable("a token of spaces is also in the vocabulary spelled with \u2581")
    return spelled


def _merges(vocab: GGUFVocab, spelled: tuple[str, ...], flavour: Flavour
            ) -> list[tuple[str, str]]:
    if vocab.merges is not None:
        pairs = [tuple(m.split(" ")) for m in vocab.merges]
        if any(len(p) != 2 for p in pairs):
            raise NotBuildable("a merge is not two tokens separated by one space")
        return pairs  # type: ignore[return-value]
    if flavour.merges_by_position:  # Gemma's scores do not follow its merge order
        return derive_merges_by_position(spelled)
    return derive_merges(spelled, vocab.scores)  # type: ignore[arg-type]


def _special_tokens(vocab: GGUFVocab, flavour: Flavour, known: set[str]) -> dict[str, str]:
    """bos/eos/unk/pad from the file, then the class's defaults, in transformers' order."""
    named = {"bos_token": vocab.bos_id, "eos_token": vocab.eos_id, "unk_token": vocab.unk_id,
             "pad_token": vocab.pad_id}
    found = {k: vocab.tokens[i] for k, i in named.items() if i is not None}
    for name, text in flavour.defaults:
        if text not in known:  # transformers would add it as a new id past the embedding
            raise NotBuildable(f"{flavour.name}'s default {name} {text!r} is not a token")
        found.setdefault(name, text)
    return {k: found[k] for k in SPECIAL_TOKEN_NAMES if k in found}


def _backend(vocab: GGUFVocab, flavour: Flavour, source: str | Path
             ) -> tuple[Tokenizer, set[str]]:
    """The BPE model with byte fallback, the flavour's steps and the added tokens; and the
    BPE model's tokens (what get_vocab(with_added_tokens=False) lists, without its ~0.4 s)."""
    spelled = _spelled(vocab, flavour)
    keys = ("tokenizer.ggml.tokens and tokenizer.ggml.merges" if vocab.merges is not None
            else "tokenizer.ggml.tokens (merges derived from the vocabulary)")
    with building_tokenizer(source, keys):
        bpe = models.BPE(vocab={t: i for i, t in enumerate(spelled)},
                         merges=_merges(vocab, spelled, flavour), dropout=None,
                         unk_token=flavour.bpe_unk, fuse_unk=True, byte_fallback=True)
        backend = Tokenizer(bpe)
        backend.normalizer = flavour.normalizer()
        backend.pre_tokenizer = flavour.pre_tokenizer()
        backend.decoder = flavour.decoder()
    known = set(spelled)
    types = vocab.token_types or ()
    control = [vocab.tokens[i] for i, t in enumerate(types) if t == CONTROL]
    if any(t not in known for t in control):
        raise NotBuildable("a control token is not in the vocabulary as spelled")
    # control tokens are special; user-defined ones are matched whole in any text (as
    # llama.cpp does) but are not special; transformers skips those not in the vocabulary
    with building_tokenizer(source, "tokenizer.ggml.token_type"):
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in control])
        backend.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types)
                            if t == USER_DEFINED and vocab.tokens[i] in known])
    return backend, known


def build_spm_tokenizer(vocab: GGUFVocab, architecture: Optional[str], add_bos: bool,
                        source: str | Path = "the GGUF vocabulary") -> FastTokenizer:
    """The tokenizer of a SentencePiece GGUF vocabulary (checked by check_vocab) as
    transformers' GGUF converter builds it for architecture; add_bos: whether prompts start
    with bos. NotBuildable where it would not be the same, ModelFileError naming source and
    the keys where the tokenizers library refuses the vocabulary."""
    if vocab.model != "llama":
        raise NotBuildable(f"tokenizer.ggml.model is {vocab.model!r}, not SentencePiece ('llama')")
    flavour = _flavour(vocab, architecture)
    backend, known = _backend(vocab, flavour, source)
    specials = _special_tokens(vocab, flavour, known)
    spec = TokenizerSpec(special_tokens=specials, chat_template=vocab.chat_template,
                         add_bos_token=add_bos and "bos_token" in specials,
                         add_eos_token=bool(vocab.add_eos) and "eos_token" in specials)
    with building_tokenizer(source, "the special tokens (tokenizer.ggml.*_token_id, add_*_token)"):
        return FastTokenizer(backend, spec)
