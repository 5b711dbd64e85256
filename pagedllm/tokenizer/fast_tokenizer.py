"""pagedllm's tokenizer: the Rust `tokenizers.Tokenizer` with what transformers keeps beside it
(special tokens, the chat template, decode flags). For what the engine uses it behaves as
transformers 5.24's PreTrainedTokenizerFast does (tested against it on the shipped models),
without importing transformers: ~1 s of every start-up.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from tokenizers import AddedToken, Tokenizer, processors

from pagedllm.tokenizer.chat_template import render_chat_template

# transformers' named special tokens, in its order (SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
NO_MAX_LENGTH = int(1e30)  # transformers' VERY_LARGE_INTEGER: the model sets no limit
ChatTemplate = Union[str, dict[str, str]]  # one template, or named ones ("default", "tool_use")
# apply_chat_template options of transformers' not offered here: refused unless unset or falsy
_UNSUPPORTED_CHAT_OPTIONS = ("sanitize_control_tokens", "padding", "truncation", "max_length",
                             "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer has besides its tokenizer.json (tokenizer_config.json's part)."""

    # name -> text: bos_token, eos_token, ... and model-specific ones (image_token); in
    # transformers' order, which is the order of the chat template's variables
    special_tokens: dict[str, str] = field(default_factory=dict)
    extra_special_tokens: tuple[str, ...] = ()  # special without a name
    chat_template: Optional[ChatTemplate] = None
    # set (True or False): the post-processor is rewritten to add bos/eos or not, as
    # transformers does when tokenizer_config.json names them; None: tokenizer.json's is kept
    add_bos_token: Optional[bool] = None
    add_eos_token: Optional[bool] = None
    clean_up_tokenization_spaces: bool = False
    clean_up_bpe: bool = False  # ..._for_bpe_even_though_it_will_corrupt_output
    split_special_tokens: bool = False  # special-token text in a prompt is encoded as plain text
    model_max_length: int = NO_MAX_LENGTH

    def __post_init__(self) -> None:
        for name, text in self.special_tokens.items():
            if not name.endswith("_token") or not isinstance(text, str):
                raise ValueError(f"special_tokens[{name!r}] must be a string and its name end "
                                 f"in _token, got {text!r}")
        if not all(isinstance(t, str) for t in self.extra_special_tokens):
            raise ValueError("extra_special_tokens must be strings, got "
                             f"{self.extra_special_tokens!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, (str, dict)):
            raise ValueError("chat_template must be a string or a dict of named templates, got "
                             f"{type(self.chat_template).__name__}")


def prepare_backend(backend: Tokenizer, spec: TokenizerSpec) -> None:
    """Set backend up as transformers' TokenizersBackend.__init__ does: no truncation or
    padding (its encode turns both off), special tokens missing from it added, and the
    post-processor rewritten when bos/eos adding is named (or there is none)."""
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = spec.split_special_tokens
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = []
    for text in (*spec.special_tokens.values(), *spec.extra_special_tokens):
        if text not in present and text not in missing:
            missing.append(text)
    if missing:
        backend.add_tokens([AddedToken(t, special=True) for t in missing])
    if spec.add_bos_token is not None or spec.add_eos_token is not None \
            or backend.post_processor is None:
        backend.post_processor = _bos_eos_processor(backend, spec)


def _bos_eos_processor(backend: Tokenizer, spec: TokenizerSpec) -> processors.TemplateProcessing:
    """transformers' update_post_processor: bos before and eos after each sequence, if asked
    for and the token exists."""
    bos, eos = spec.special_tokens.get("bos_token"), spec.special_tokens.get("eos_token")
    add_bos = bool(spec.add_bos_token) and bos is not None
    add_eos = bool(spec.add_eos_token) and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = (f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1"
            f"{(' ' + eos + ':1') if add_eos else ''}")
    specials = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
               ([(eos, backend.token_to_id(eos))] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions (WordPiece's)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _py(ids: Any) -> Any:
    """Token ids as Python ints or lists of them (numpy arrays and torch tensors too)."""
    return ids.tolist() if hasattr(ids, "tolist") else ids


class FastTokenizer:
    """A tokenizer over the Rust `tokenizers.Tokenizer`: encode/decode, special tokens and the
    chat template, as transformers' PreTrainedTokenizerFast gives them.

    `transformers_source` is the transformers tokenizer it was made from, if any:
    LLM.get_tokenizer() hands that one out rather than building another."""

    def __init__(self, backend: Tokenizer, spec: TokenizerSpec, *,
                 transformers_source: Any = None) -> None:
        prepare_backend(backend, spec)
        self._backend, self.spec, self.transformers_source = backend, spec, transformers_source

    def __repr__(self) -> str:
        return (f"FastTokenizer(vocab_size={self.vocab_size}, len={len(self)}, "
                f"special_tokens={self.special_tokens_map})")

    def __bool__(self) -> bool:  # as transformers': never the vocabulary's size
        return True

    def __len__(self) -> int:
        """Size of the vocabulary with the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary (without the added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The Rust tokenizer (the detokenizer's DecodeStream and llguidance read it)."""
        return self._backend

    @property
    def chat_template(self) -> Optional[ChatTemplate]:
        """The model's chat template (or named templates), None if it has none."""
        return self.spec.chat_template

    @chat_template.setter
    def chat_template(self, template: Optional[ChatTemplate]) -> None:
        # settable, as transformers' is (a server's --chat-template, tests)
        self.spec = replace(self.spec, chat_template=template)

    @property
    def model_max_length(self) -> int:
        """tokenizer_config.json's model_max_length (NO_MAX_LENGTH where none is set)."""
        return self.spec.model_max_length

    def get_vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """id -> AddedToken of the tokens added to the base vocabulary."""
        return self._backend.get_added_tokens_decoder()

    # ---- special tokens ----------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """name -> text of the named special tokens that are set."""
        return dict(self.spec.special_tokens)

    @property
    def all_special_tokens(self) -> list[str]:
        """Named and unnamed special tokens, each once."""
        return list(dict.fromkeys((*self.spec.special_tokens.values(),
                                   *self.spec.extra_special_tokens)))

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of all_special_tokens."""
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def _special_id(self, name: str) -> Optional[int]:
        text = self.spec.special_tokens.get(name)
        return None if text is None else self.convert_tokens_to_ids(text)

    @property
    def bos_token(self) -> Optional[str]:
        """Beginning-of-sequence token text."""
        return self.spec.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> Optional[str]:
        """End-of-sequence token text."""
        return self.spec.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> Optional[str]:
        """Padding token text."""
        return self.spec.special_tokens.get("pad_token")

    @property
    def unk_token(self) -> Optional[str]:
        """Unknown-token text."""
        return self.spec.special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> Optional[int]:
        """Id of bos_token."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> Optional[int]:
        """Id of eos_token."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> Optional[int]:
        """Id of pad_token."""
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> Optional[int]:
        """Id of unk_token."""
        return self._special_id("unk_token")

    # ---- tokens and ids ----------------------------------------------------------------------

    def convert_tokens_to_ids(self, tokens: Union[str, list[str]]) -> Union[Optional[int], list]:
        """Id of a token (or of each); unk_token_id for one not in the vocabulary."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> Optional[int]:
        index = self._backend.token_to_id(token)
        if index is not None:
            return index
        unk = self.spec.special_tokens.get("unk_token")
        return None if unk is None else self._backend.token_to_id(unk)

    def convert_ids_to_tokens(self, ids: Union[int, list[int]], skip_special_tokens: bool = False
                              ) -> Union[Optional[str], list[Optional[str]]]:
        """Token text of an id (or of each; None for an id outside the vocabulary)."""
        ids = _py(ids)
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens: the post-processor's bos/eos too."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        # encode_batch, as transformers calls it: it lets go of the GIL (encode does not), so a
        # long prompt tokenized on a worker thread does not stall the server's event loop
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_truncated(self, text: str, pair: Optional[str] = None,
                         max_length: Optional[int] = None) -> tuple[list[int], Optional[int]]:
        """Token ids of text (and of a second text, pair: a cross-encoder's query and
        document) with the special tokens, cut to max_length tokens as transformers'
        `truncation=True` cuts (from the right, the longer text first for a pair); and where
        the pair's second text starts (its token type 1), None without a pair or when the
        tokenizer does not mark the texts apart."""
        for name, value in (("text", text), ("pair", pair)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        texts = [text] if pair is None else [text, pair]
        parts = self._backend.encode_batch(texts, add_special_tokens=False)
        if max_length is not None:
            budget = max_length - self._backend.num_special_tokens_to_add(pair is not None)
            if budget < len(parts):
                raise ValueError(f"truncation to {max_length} tokens leaves no room for the "
                                 "input's own tokens beside its special tokens")
            lengths = [len(p.ids) for p in parts]
            while sum(lengths) > budget:  # longest_first: one token off the longer text
                lengths[lengths.index(max(lengths))] -= 1
            for part, n in zip(parts, lengths):
                part.truncate(n)
        enc = self._backend.post_process(parts[0], parts[1] if pair is not None else None,
                                         add_special_tokens=True)
        types = list(enc.type_ids)
        second = next((i for i, t in enumerate(types) if t == 1), None)
        if second is not None and any(t != 1 for t in types[second:]):
            second = None  # not two runs of token types: left as type 0
        return list(enc.ids), second if pair is not None else None

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: Optional[bool] = None) -> Union[str, list[str]]:
        """Text of token ids (an id, a list, or a list of lists: a list of texts)."""
        ids = _py(token_ids)
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return [self._decode(list(seq), skip_special_tokens, clean_up_tokenization_spaces)
                    for seq in ids]
        return self._decode(list(ids), skip_special_tokens, clean_up_tokenization_spaces)

    def _decode(self, ids: list[int], skip_special_tokens: bool, clean_up: Optional[bool]) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean_up = self.spec.clean_up_tokenization_spaces if clean_up is None else clean_up
        # transformers skips the clean-up for BPE: it would strip real spaces before punctuation
        if clean_up and (type(self._backend.model).__name__ != "BPE" or self.spec.clean_up_bpe):
            text = clean_up_tokenization(text)
        return text

    # ---- chat --------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: Optional[str] = None,
                          tools: Optional[list] = None) -> str:
        """The template to render: chat_template (a text, or the name of one of the model's),
        else the model's ("tool_use" when there are tools and it has one, else "default")."""
        own = self.spec.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError("This model has multiple chat templates with no default "
                                 "specified! Please either pass a chat template or the name of "
                                 "the template you wish to use to the `chat_template` argument. "
                                 f"Available template names are {sorted(own)}.")
        elif chat_template is None:
            if own is None:
                raise ValueError("Cannot use chat template functions because "
                                 "tokenizer.chat_template is not set and no template argument "
                                 "was passed! For information about writing templates and "
                                 "setting the tokenizer.chat_template attribute, please see the "
                                 "documentation at "
                                 "https://huggingface.co/docs/transformers/main/en/chat_templating")
            return own
        return chat_template

    def apply_chat_template(self, conversation: Any, tools: Optional[list] = None,
                            documents: Optional[list] = None, chat_template: Optional[str] = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: Union[bool, str] = False,
                            tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> Union[str, list[int], dict[str, list[int]]]:
        """The conversation through the chat template, as transformers renders it: the text
        (tokenize=False), its ids encoded without added special tokens (return_dict=False),
        or {"input_ids", "attention_mask"}. Other kwargs are template variables."""
        for name in _UNSUPPORTED_CHAT_OPTIONS:
            if kwargs.pop(name, None):
                raise ValueError(f"apply_chat_template option {name} is not supported by "
                                 "pagedllm's tokenizer (LLM.get_tokenizer() gives transformers')")
        template = self.get_chat_template(chat_template, tools)
        text = render_chat_template(template, conversation, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    variables={**self.spec.special_tokens, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids
