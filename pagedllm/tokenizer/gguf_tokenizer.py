"""A Hugging Face tokenizer for a GGUF file, built from the vocabulary in its metadata.

A byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": Qwen2, Llama 3, SmolLM, GPT-2) is
built here directly into a `tokenizers.Tokenizer`, with the pre-tokenizer llama.cpp applies for
`tokenizer.ggml.pre` written the way the model's own tokenizer.json writes it: ~1 s for Qwen2's
152k tokens. A SentencePiece one ("llama": Gemma, Llama 2) is built by gguf_spm, a WordPiece
one ("bert": BERT encoders) by gguf_wpm, both without transformers. Anything else (an unknown
pre-tokenizer or architecture, an odd vocabulary) goes to transformers' GGUF loader, with an
INFO line saying why; it is exact but walks every metadata string through numpy (~10 s for a
152k vocabulary, ~21 s for Gemma's 262k). transformers is imported only when a byte-level or
fallback tokenizer is built (the cache of gguf_tokenizer_cache keeps what is built here).
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from pagedllm.loader.errors import NotBuildable, building_tokenizer
from pagedllm.tokenizer.fast_tokenizer import FastTokenizer
from pagedllm.loader.gguf.header import gguf_arrays, gguf_header
from pagedllm.tokenizer.gguf_spm import CONTROL, USER_DEFINED, build_spm_tokenizer
from pagedllm.loader.gguf.vocab import GGUFVocab, read_gguf_vocab
from pagedllm.loader.gguf.vocab_checks import check_vocab, check_vocab_header
from pagedllm.tokenizer.gguf_wpm import build_wpm_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger("pagedllm")

# The split regexes of the models' own tokenizer.json files (llama.cpp runs the same ones).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenization:
    """How llama.cpp cuts text before BPE for one `tokenizer.ggml.pre` value."""

    split_regex: Optional[str] = None  # None: byte-level's own GPT-2 regex
    individual_digits: bool = False  # every digit on its own (SmolLM, StarCoder)
    ignore_merges: bool = False  # a word that is a whole vocabulary entry stays one token (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token flag

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        """The `tokenizers` pre-tokenizer that cuts the same way."""
        steps = []
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if self.split_regex is not None:
            steps.append(pre_tokenizers.Split(Regex(self.split_regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False,
                                              use_regex=self.split_regex is None))
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


# tokenizer.ggml.pre -> its pre-tokenization; names follow llama.cpp's llama-vocab.cpp.
PRE_TOKENIZATIONS: dict[str, PreTokenization] = {
    "gpt-2": PreTokenization(),
    "qwen2": PreTokenization(_QWEN2_SPLIT),
    "deepseek-r1-qwen": PreTokenization(_QWEN2_SPLIT),
    "llama3": PreTokenization(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenization(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama-bpe": PreTokenization(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "smollm": PreTokenization(individual_digits=True),
}


def adds_bos(vocab: GGUFVocab) -> bool:
    """Whether llama.cpp starts every prompt with bos: the file's add_bos_token, else the
    default of its pre-tokenizer (byte-level BPE) or of SentencePiece (on)."""
    if vocab.add_bos is not None:
        return vocab.add_bos
    if vocab.model == "gpt2":
        return PRE_TOKENIZATIONS.get(vocab.pre or "", PreTokenization()).add_bos
    return vocab.model in ("llama", "bert")  # SentencePiece's <s>, WordPiece's [CLS]


def _check_vocab(vocab: GGUFVocab) -> PreTokenization:
    """The pre-tokenization of a vocabulary this module builds exactly, else NotBuildable."""
    if vocab.model != "gpt2":
        raise NotBuildable(f"tokenizer.ggml.model is {vocab.model!r}; only byte-level BPE "
                           "('gpt2') is built from the metadata here")
    if vocab.pre not in PRE_TOKENIZATIONS:
        raise NotBuildable(f"tokenizer.ggml.pre {vocab.pre!r} is not one of "
                           f"{', '.join(sorted(PRE_TOKENIZATIONS))}")
    if not vocab.merges:
        raise NotBuildable("the file has no tokenizer.ggml.merges")
    if vocab.token_types is not None and len(vocab.token_types) != len(vocab.tokens):
        raise NotBuildable(f"{len(vocab.token_types)} token types for {len(vocab.tokens)} tokens")
    if len(set(vocab.tokens)) != len(vocab.tokens):
        raise NotBuildable("the vocabulary holds a token twice")
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    for i, token in enumerate(vocab.tokens):  # special tokens too: llama.cpp matches them as written
        if not token or not alphabet.issuperset(token):
            raise NotBuildable(f"token {i} {token!r} is not spelled in the byte-level alphabet")
    return PRE_TOKENIZATIONS[vocab.pre]


def _merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ")) for m in vocab.merges]
    bad = next((m for m, p in zip(vocab.merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise NotBuildable(f"merge {bad!r} is not two tokens separated by one space")
    return pairs  # type: ignore[return-value]


def _backend(vocab: GGUFVocab, pre: PreTokenization, source: str | Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a checked byte-level BPE vocabulary."""
    with building_tokenizer(source, "tokenizer.ggml.tokens and tokenizer.ggml.merges"):
        bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)},
                         merges=_merges(vocab), dropout=None, unk_token=None,
                         continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                         byte_fallback=False, ignore_merges=pre.ignore_merges)
        backend = Tokenizer(bpe)
    with building_tokenizer(source, f"tokenizer.ggml.pre={vocab.pre!r}"):
        backend.pre_tokenizer = pre.pre_tokenizer()
        backend.decoder = decoders.ByteLevel()
    types = vocab.token_types or ()
    # control tokens (<|im_start|>) are special; user-defined ones (<tool_call>) are matched
    # whole in any text, as llama.cpp does, but are not special
    with building_tokenizer(source, "tokenizer.ggml.token_type"):
        backend.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == CONTROL])
        backend.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == USER_DEFINED])
    return backend


def _special_token(vocab: GGUFVocab, token_id: Optional[int]) -> Optional[str]:
    """The text of a special token id (read_gguf_vocab checked it is in the vocabulary)."""
    return None if token_id is None else vocab.tokens[token_id]


def _special_tokens(vocab: GGUFVocab) -> dict[str, Optional[str]]:
    """bos/eos/pad/unk token texts for the wrapper (None where the file names none)."""
    return {"bos_token": _special_token(vocab, vocab.bos_id),
            "eos_token": _special_token(vocab, vocab.eos_id),
            "pad_token": _special_token(vocab, vocab.pad_id),
            "unk_token": _special_token(vocab, vocab.unk_id)}


def build_tokenizer(vocab: GGUFVocab, source: str | Path = "the GGUF vocabulary"
                    ) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer for a GGUF vocabulary (read from source); NotBuildable if
    not exact, ModelFileError naming source and the keys if the tokenizers library refuses it."""
    from transformers import PreTrainedTokenizerFast

    pre = _check_vocab(vocab)
    backend = _backend(vocab, pre, source)
    specials = _special_tokens(vocab)
    # an explicit add_bos_token/add_eos_token makes transformers write the post-processor
    with building_tokenizer(source, "the special tokens (tokenizer.ggml.*_token_id, add_*_token)"):
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend, add_bos_token=adds_bos(vocab),
            add_eos_token=bool(vocab.add_eos), clean_up_tokenization_spaces=False,
            **{k: v for k, v in specials.items() if v is not None})
    tok.chat_template = vocab.chat_template
    return tok


def _match_metadata(tok: PreTrainedTokenizerBase, vocab: GGUFVocab) -> None:
    """Make chat template and special tokens agree with the GGUF metadata (transformers does
    not always carry them over)."""
    if vocab.chat_template is not None and tok.chat_template != vocab.chat_template:
        tok.chat_template = vocab.chat_template
    for attr, text in _special_tokens(vocab).items():
        if text is not None and getattr(tok, attr) != text:
            setattr(tok, attr, text)
    # llama.cpp starts a SentencePiece prompt with bos, named in the file or its default <s>;
    # transformers adds none where the file names none
    if adds_bos(vocab) and vocab.bos_id is not None and getattr(tok, "add_bos_token", 0) is False:
        tok.add_bos_token = True


def transformers_tokenizer(path: Path, vocab: GGUFVocab, *,
                           trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer, with the file's template and special tokens."""
    from transformers import AutoTokenizer

    # a folder holding only the GGUF, so tokenizer files beside it cannot leak in
    keys = f"tokenizer.ggml.model={vocab.model!r} (through transformers' GGUF converter)"
    with tempfile.TemporaryDirectory(prefix="pagedllm-gguf-tok-") as tmp, building_tokenizer(path, keys):
        (Path(tmp) / path.name).symlink_to(path.resolve())
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    _match_metadata(tok, vocab)
    return tok


def _build_from_metadata(vocab: GGUFVocab, architecture: Optional[str], path: Path
                         ) -> FastTokenizer | PreTrainedTokenizerFast:
    """The tokenizer built here: SentencePiece by gguf_spm and WordPiece by gguf_wpm (no
    transformers), byte-level BPE by build_tokenizer; NotBuildable for any other kind."""
    if vocab.model == "llama":
        return build_spm_tokenizer(vocab, architecture, adds_bos(vocab), path)
    if vocab.model == "bert":
        return build_wpm_tokenizer(vocab, path)
    return build_tokenizer(vocab, path)


def tokenizer_from_gguf(path: str | Path, *, trust_remote_code: bool = False
                        ) -> FastTokenizer | PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes: built from its metadata, or by transformers when
    it is of a kind not built here (logged at INFO with the reason); ModelFileError naming the
    file and the key for tokenizer metadata that is inconsistent or incomplete."""
    path = Path(path)
    fields, tensors = gguf_header(path)  # a file the engine would refuse is refused here too
    check_vocab_header(fields, gguf_arrays(path), tensors, path)  # before any token is read
    vocab = read_gguf_vocab(path)
    vocab = check_vocab(vocab, fields, adds_bos(vocab), path)
    try:
        return _build_from_metadata(vocab, fields.get("general.architecture"), path)
    except NotBuildable as why:
        logger.info("tokenizer of %s: %s; using transformers' GGUF tokenizer instead "
                    "(slower: it reads every metadata string through numpy)", path, why)
    return transformers_tokenizer(path, vocab, trust_remote_code=trust_remote_code)
