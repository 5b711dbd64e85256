"""known_templates: each format renders exactly, is chosen by the vocabulary's special tokens,
and the end-of-turn tokens join the eos ids of a GGUF without changing the shipped models'."""
from __future__ import annotations

import jinja2.exceptions
import pytest

from pagedllm.engine.llm_engine import _eos_ids
from pagedllm.tokenizer.chat_template import render_chat_template
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.tokenizer.known_templates import (CHATML_TEMPLATE, GEMMA_TEMPLATE, KNOWN_TEMPLATES,
                                             LLAMA3_TEMPLATE, END_OF_TURN_TOKENS,
                                             end_of_turn_ids, known_template)
from pagedllm.tokenizer.tokenizer import load_tokenizer

CHAT = [{"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]


def _render(template: str, bos: str = "<s>") -> str:
    return render_chat_template(template, CHAT, add_generation_prompt=True,
                                variables={"bos_token": bos})


def test_chatml_renders_the_text_as_written():
    assert _render(CHATML_TEMPLATE) == (
        "<|im_start|>system\n Be brief. <|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_llama3_renders_headers_and_eot():
    assert _render(LLAMA3_TEMPLATE, "<|begin_of_text|>") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_gemma_folds_the_system_message_and_names_the_model():
    assert _render(GEMMA_TEMPLATE, "<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")
    without = render_chat_template(GEMMA_TEMPLATE, CHAT[1:2], variables={"bos_token": "<bos>"})
    assert without == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_gemma_refuses_a_role_it_has_not():
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles user and assistant.*tool"):
        render_chat_template(GEMMA_TEMPLATE, [*CHAT[1:3], {"role": "tool", "content": "4"}],
                             variables={"bos_token": "<bos>"})


def test_every_format_ends_its_turns_with_an_end_of_turn_token():
    for known in KNOWN_TEMPLATES:
        assert known.end_of_turn in END_OF_TURN_TOKENS and known.end_of_turn in known.template


def _tokenizer(gguf):
    return load_tokenizer(resolve_checkpoint(gguf).tokenizer_path)


def test_shipped_models_keep_their_own_template_and_eos(qwen_gguf, smollm_gguf):
    for gguf, eos in ((qwen_gguf, {151645}), (smollm_gguf, {2})):
        tok = _tokenizer(gguf)
        assert known_template(tok).name == "ChatML"  # their vocabularies are ChatML's
        assert "<|im_start|>" in tok.chat_template and tok.chat_template != CHATML_TEMPLATE
        arch = resolve_checkpoint(gguf).arch
        assert set(arch.eos_token_ids) == eos  # <|im_end|>, named by the file
        assert end_of_turn_ids(tok) == eos
        assert _eos_ids(arch, {}, tok, gguf=True) == eos


def test_gemma_is_chosen_by_its_vocabulary_and_end_of_turn_joins_eos(gemma_gguf):
    tok = _tokenizer(gemma_gguf)
    assert known_template(tok).name == "Gemma" and tok.chat_template == GEMMA_TEMPLATE
    arch = resolve_checkpoint(gemma_gguf).arch
    assert arch.eos_token_ids == (1,)  # <eos> only: the file has no eot_token_id
    assert end_of_turn_ids(tok) == {106}  # <end_of_turn>
    assert _eos_ids(arch, {}, tok, gguf=True) == {1, 106}
    assert _eos_ids(arch, {}, tok, gguf=False) == {1}  # HF checkpoints: generation_config rules
