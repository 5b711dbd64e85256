"""Chat formats known by their special tokens: the template a GGUF without
`tokenizer.chat_template` chats with, and the end-of-turn tokens that end generation as EOS does.

The format is chosen from the vocabulary, not from `general.architecture`: an architecture does
not fix a chat format (`llama` GGUFs chat in Llama 2's [INST], Llama 3's headers or ChatML, as
SmolLM2 does; `qwen2` ones in ChatML or DeepSeek's), while a template only works where its turn
markers are single special tokens the model was trained on. Ollama and llama.cpp fall back the
same way on a GGUF without a template (llama.cpp's llm_chat_detect_template looks for the
markers in the text of the template, Ollama's for the tokens in the vocabulary).

The templates are written here for pagedllm (rendered by chat_template.py, as transformers
renders the models' own); each one writes bos_token where the model's own template does, since
apply_chat_template encodes the text without adding special tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pagedllm.tokenizer.fast_tokenizer import FastTokenizer

logger = logging.getLogger("pagedllm")

# The text of a message: a string, or the text parts of OpenAI content parts.
_TEXT_MACRO = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}\n")

# Gemma: no system role (a system message opens the first user turn, as Gemma's own template
# and llama.cpp's "gemma" do); the assistant's turns are the model's; each turn's text trimmed.
GEMMA_TEMPLATE = _TEXT_MACRO + """{{- bos_token -}}
{%- set ns = namespace(prefix='') -%}
{%- set turns = messages -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.prefix = text(messages[0].content) | trim + '\n\n' -%}
{%- set turns = messages[1:] -%}
{%- endif -%}
{%- for message in turns -%}
{%- if message.role not in ('user', 'assistant') -%}
{{- raise_exception('the Gemma chat format has the roles user and assistant (and one '
                    + 'system message first), not ' + message.role) -}}
{%- endif -%}
{{- '<start_of_turn>' + ('model' if message.role == 'assistant' else 'user') + '\n' -}}
{{- ns.prefix if loop.first else '' -}}
{{- text(message.content) | trim -}}
{{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# Llama 3: a header per message, the text trimmed, <|eot_id|> after each; bos first.
LLAMA3_TEMPLATE = _TEXT_MACRO + """{{- bos_token -}}
{%- for message in messages -%}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' -}}
{{- text(message.content) | trim -}}
{{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

# ChatML: <|im_start|>role, the text as written, <|im_end|>; no bos, no default system prompt.
CHATML_TEMPLATE = _TEXT_MACRO + """{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


@dataclass(frozen=True)
class KnownTemplate:
    """A chat format: its template and the special tokens a vocabulary must hold to use it."""

    name: str
    markers: tuple[str, ...]  # all of them special tokens of the vocabulary: this format
    end_of_turn: str  # what closes the assistant's turn
    template: str


# in the order they are tried: a vocabulary holding several formats' markers (Gemma's and
# ChatML's, say) chats in the first
KNOWN_TEMPLATES = (
    KnownTemplate("Gemma", ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>",
                  GEMMA_TEMPLATE),
    KnownTemplate("Llama 3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                  "<|eot_id|>", LLAMA3_TEMPLATE),
    KnownTemplate("ChatML", ("<|im_start|>", "<|im_end|>"), "<|im_end|>", CHATML_TEMPLATE),
)

# Tokens that end a turn wherever a vocabulary holds them as special tokens: llama.cpp's
# end-of-generation texts (llama-vocab.cpp) less the two that do not end a chat turn:
# <|endoftext|>, the document separator of GPT-2-style vocabularies (SmolLM2's unk token), and
# the FIM tokens (<|fim_pad|>, <|file_sep|>, <|repo_name|>), which end an infill, not a turn.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>",
                      "<EOT>")


def _special_ids(tokenizer: FastTokenizer) -> dict[str, int]:
    """text -> id of the tokenizer's special tokens (control tokens of a GGUF)."""
    return {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def known_template(tokenizer: FastTokenizer) -> Optional[KnownTemplate]:
    """The first known chat format whose markers are all special tokens of tokenizer."""
    special = _special_ids(tokenizer)
    return next((k for k in KNOWN_TEMPLATES if all(m in special for m in k.markers)), None)


def with_known_template(tokenizer: FastTokenizer, source: str | Path) -> FastTokenizer:
    """tokenizer, given the known template of its vocabulary when it has none of its own
    (logged once, with how to override it); unchanged if it has one or no format fits."""
    if tokenizer.chat_template is not None:
        return tokenizer
    known = known_template(tokenizer)
    if known is None:
        return tokenizer
    tokenizer.chat_template = known.template
    logger.info("%s has no chat template (tokenizer.chat_template); using pagedllm's built-in "
                "%s template, chosen because its vocabulary has the special tokens %s; pass "
                "--chat-template FILE (serve) or LLM.chat(chat_template=...) to use another",
                source, known.name, " ".join(known.markers))
    return tokenizer


def end_of_turn_ids(tokenizer: FastTokenizer) -> frozenset[int]:
    """Ids of the END_OF_TURN_TOKENS the tokenizer holds as special tokens."""
    special = _special_ids(tokenizer)
    return frozenset(special[t] for t in END_OF_TURN_TOKENS if t in special)
