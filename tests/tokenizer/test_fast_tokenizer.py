"""pagedllm's FastTokenizer against transformers' tokenizer on the shipped models' exported
tokenizer folders: ids, text, special tokens and chat templates (with their errors).

The reference is the tokenizer the engine used before FastTokenizer: transformers'
PreTrainedTokenizerFast built from the folder's tokenizer.json and tokenizer_config.json. (Not
AutoTokenizer: for Qwen2 it picks Qwen2Tokenizer, which rebuilds the pipeline with an NFC
normalizer the exported tokenizer.json, like llama.cpp, does not have.)
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2.exceptions
import pytest
from transformers import PreTrainedTokenizerFast

from pagedllm.tokenizer.chat_messages import render_chat, template_messages
from pagedllm.tokenizer.fast_tokenizer import FastTokenizer
from pagedllm.tokenizer.hf_tokenizer import to_transformers, wrap_transformers
from pagedllm.hub.model_store import ensure_model
from pagedllm.tokenizer.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "",
    " ",
    "  two leading spaces, and trailing   ",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\n\tif x != 0: pass\r\n",
    "naïve café über Ærøskøbing — “quotes” … e\u0301 decomposed",
    "中文测试，日本語のテキスト、한국어 문장 العربية עברית",
    "emoji 🤗🚀 family 👩‍👩‍👧 flag 🇯🇵 skin 👍🏽 keycap 1️⃣",
    "whitespace runs:\t\t\t  \n\n   \u3000\u00a0\u2003 end\n\n\n\n",
    "control \x00\x01\x04\x06\x13\x1b[0m\x7f\u200b\u200d\ufeff\u2028 chars",
    "numbers 0 7 42 2024 123456789 3.14159 1e-10 x² ½ ٣",
    "I'm sure you'LL see THEY'RE we'd",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> glued<|im_end|>text <|im_start|",
    "<tool_call>{\"name\": \"f\"}</tool_call> <|fim_prefix|>x<|fim_suffix|>",
    "a .b ?c !d ,e ' f n't 'm 's 've 're",
    "x" * 3000,
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & \"later\" for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'}}
CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Write 2+2 in Python: 中文 🤗"}],
    "user only": [{"role": "user", "content": "hi <|im_end|> there"}],
    "multi-turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi! How can I help?"},
                   {"role": "user", "content": "  spaces \n\n and lines  "}],
    "tool calls": [{"role": "user", "content": "Weather in Zürich?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"t": 21}'},
                   {"role": "tool", "tool_call_id": "call_2", "content": "<b>ok</b>"},
                   {"role": "assistant", "content": "It is 21 °C."}],
}
# a template exercising transformers' environment: namespace, loop controls, its tojson, dict(),
# the generation tag, trim/lstrip blocks, special-token variables and extra kwargs
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}
  {% else %}{{ m.role }}: {{ m.content | default('none') | tojson }} {{ m | tojson(indent=2, sort_keys=True) }}
  {% endif %}
{% endfor %}
{{ ns.n }} {{ dict(a=1, b='<&>') | tojson(separators=(',', ':')) }} {{ eos_token }}
{{ tools | tojson }} {{ documents | tojson }} {{ custom_flag }} {{ strftime_now('%Y') }}
{% if add_generation_prompt %}GO{% endif %}"""
RAISES = "{% if messages | length > 1 %}{{ raise_exception('only one message, got ' ~ (messages | length)) }}{% endif %}{{ messages[0].content }}"


@dataclass(frozen=True)
class Pair:
    """One shipped model's exported folder, loaded by pagedllm and by transformers."""

    name: str
    ours: FastTokenizer
    reference: Any  # transformers' tokenizer of the same folder


# tokenizer_config.json keys transformers' PreTrainedTokenizerFast takes (the rest is in tokenizer.json)
CONFIG_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length",
               "add_bos_token", "add_eos_token", "split_special_tokens", "clean_up_tokenization_spaces")


def transformers_from_folder(folder: Path) -> PreTrainedTokenizerFast:
    """transformers' tokenizer of an exported folder, as the engine loaded it before."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                  **{k: config[k] for k in CONFIG_KEYS if config.get(k) is not None})
    tok.chat_template = (folder / "chat_template.jinja").read_text()
    return tok


@pytest.fixture(scope="session", params=["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"])
def pair(request) -> Pair:
    folder = ensure_model(request.param)
    return Pair(request.param, load_tokenizer(folder), transformers_from_folder(folder))


def _both(pair: Pair, method: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    return getattr(pair.ours, method)(*args, **kwargs), getattr(pair.reference, method)(*args, **kwargs)


def _raised(fn: Any) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def _outcome(fn: Any) -> Any:
    """fn's result, or the class and text of what it raised (SmolLM2's template cannot render
    a tool call: both tokenizers must fail alike)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - compared, not hidden
        return type(err), str(err)


def test_loaded_from_the_folder_without_transformers_type(pair):
    assert type(pair.ours) is FastTokenizer and isinstance(pair.reference, PreTrainedTokenizerFast)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches(pair, text):
    for special in (True, False):
        ours, ref = _both(pair, "encode", text, add_special_tokens=special)
        assert ours == ref, special


def test_decode_matches(pair):
    ref = pair.reference
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (False, True):
            assert pair.ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        # BPE: transformers ignores the clean-up even when asked for it
        assert (pair.ours.decode(ids, clean_up_tokenization_spaces=True)
                == ref.decode(ids, clean_up_tokenization_spaces=True))
    specials = ref.all_special_ids
    every = list(range(0, len(ref), 97)) + specials
    for skip in (False, True):
        assert pair.ours.decode(every, skip_special_tokens=skip) == ref.decode(every, skip_special_tokens=skip)
    assert pair.ours.decode(specials[0]) == ref.decode(specials[0])  # one id
    assert pair.ours.decode([[5, 6], [7]]) == ref.decode([[5, 6], [7]])  # a batch
    assert pair.ours.decode([]) == ref.decode([]) == ""


def test_tokens_and_ids_match(pair):
    ref = pair.reference
    every = list(range(0, len(ref), 89)) + ref.all_special_ids + [len(ref) - 1]
    for skip in (False, True):
        assert _both(pair, "convert_ids_to_tokens", every, skip_special_tokens=skip)[0] == \
            ref.convert_ids_to_tokens(every, skip_special_tokens=skip)
    assert pair.ours.convert_ids_to_tokens(every[3]) == ref.convert_ids_to_tokens(every[3])
    tokens = ref.convert_ids_to_tokens(every) + ["<|im_start|>", "surely not a token"]
    assert pair.ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)


def test_special_tokens_and_sizes_match(pair):
    ours, ref = pair.ours, pair.reference
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "all_special_tokens", "all_special_ids",
                 "special_tokens_map", "vocab_size", "model_max_length", "chat_template"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    assert {i: (str(t), t.special, t.normalized) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (str(t), t.special, t.normalized) for i, t in ref.added_tokens_decoder.items()}
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_template_ids_match(pair, name):
    messages = template_messages(CONVERSATIONS[name])  # tool-call arguments as objects
    for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                    {"tools": TOOLS, "add_generation_prompt": True},
                    {"continue_final_message": True}):
        for tokenize in (True, False):
            ours, ref = (_outcome(lambda: tok.apply_chat_template(
                messages, tokenize=tokenize, return_dict=False, **options))
                for tok in (pair.ours, pair.reference))
            assert ours == ref, (options, tokenize)
    ours, ref = (_outcome(lambda: tok.apply_chat_template(messages)["input_ids"])
                 for tok in (pair.ours, pair.reference))
    assert ours == ref


def test_render_chat_matches_transformers(pair):
    """The engine's one chat path, on pagedllm's tokenizer and on transformers'."""
    for messages in CONVERSATIONS.values():
        for kwargs in ({}, {"tools": TOOLS}, {"continue_final_message": True},
                       {"chat_template_kwargs": {"custom_flag": 1}}):
            assert _outcome(lambda: render_chat(pair.ours, messages, **kwargs)) == \
                _outcome(lambda: render_chat(pair.reference, messages, **kwargs)), kwargs


def test_template_environment_matches(pair):
    messages = [{"role": "user", "content": "a <b> & 'c' \"d\" é"},
                {"role": "assistant", "content": "ok", "reasoning": "because"},
                {"role": "user", "content": None, "extra": (1, 2.5, True)},
                {"role": "user", "content": "never shown: the loop breaks"}]
    kwargs = dict(chat_template=FEATURES, tools=TOOLS, documents=[{"title": "t", "text": "x"}],
                  custom_flag=True, add_generation_prompt=True)
    ours, ref = _both(pair, "apply_chat_template", messages, tokenize=False, **kwargs)
    assert ours == ref and "GO" in ours and '"<&>"' in ours
    assert _both(pair, "apply_chat_template", messages, return_dict=False, **kwargs)[0] == \
        pair.reference.apply_chat_template(messages, return_dict=False, **kwargs)


@pytest.mark.parametrize("call", [
    lambda tok: tok.apply_chat_template([], tokenize=False),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}],
                                        add_generation_prompt=True, continue_final_message=True),
    lambda tok: tok.apply_chat_template([{"role": "user"}], continue_final_message=True),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}],
                                        chat_template="{{ messages[0].role }}",
                                        continue_final_message=True),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "keep  "}],
                                        chat_template="{{ messages[0].content[:3] }}",
                                        continue_final_message=True),
    lambda tok: tok.apply_chat_template(["not a dict"]),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}], documents=["doc"]),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=RAISES + "{{ 1 }}",
                                        tokenize=False) + tok.apply_chat_template(
        [{"role": "user", "content": "x"}] * 2, chat_template=RAISES),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}],
                                        chat_template="{{ ''.__class__.__mro__ }}"),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}],
                                        chat_template="{% set ns = namespace(_x=1) %}"),
    lambda tok: tok.apply_chat_template([{"role": "user", "content": "x"}],
                                        chat_template="{% for %}"),
], ids=["empty", "continue+prompt", "nothing to continue", "field not in template",
        "message cut by template", "not a dict", "document not a dict", "raise_exception",
        "sandbox", "underscore namespace", "syntax error"])
def test_chat_errors_match(pair, call):
    ours, ref = _raised(lambda: call(pair.ours)), _raised(lambda: call(pair.reference))
    assert ours == ref


def test_raise_exception_is_a_value_error_naming_messages(pair):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for tok in (pair.ours, pair.reference):
        with pytest.raises(jinja2.exceptions.TemplateError, match="only one message, got 2"):
            tok.apply_chat_template(messages, chat_template=RAISES)
        with pytest.raises(ValueError, match="messages could not be rendered by the chat "
                                             "template: only one message, got 2"):
            render_chat(tok, messages, chat_template=RAISES)


def test_named_templates_and_no_template(pair):
    named = {"default": "D{{ messages[0].content }}", "tool_use": "T{{ tools | length }}"}
    messages = [{"role": "user", "content": "x"}]
    results = []
    for tok in (pair.ours, pair.reference):
        original = tok.chat_template
        try:
            tok.chat_template = named
            results.append((tok.apply_chat_template(messages, tokenize=False),
                            tok.apply_chat_template(messages, tools=TOOLS, tokenize=False),
                            tok.apply_chat_template(messages, chat_template="tool_use",
                                                    tools=[], tokenize=False)))
            tok.chat_template = None
            results.append(_raised(lambda: tok.apply_chat_template(messages)))
        finally:
            tok.chat_template = original
    assert results[0] == results[2] == ("Dx", "T1", "T0")
    assert results[1][0] is results[3][0] is ValueError and results[1] == results[3]


def test_unsupported_options_are_refused_by_name(pair):
    messages = [{"role": "user", "content": "x"}]
    for option in ({"padding": True}, {"return_tensors": "pt"}, {"sanitize_control_tokens": True},
                   {"return_assistant_tokens_mask": True}, {"tokenizer_kwargs": {"a": 1}}):
        with pytest.raises(ValueError, match=f"option {next(iter(option))} is not supported"):
            pair.ours.apply_chat_template(messages, **option)
    with pytest.raises(ValueError, match="Python functions as tools are not supported"):
        pair.ours.apply_chat_template(messages, tools=[len])
    with pytest.raises(ValueError, match="batches of conversations are not supported"):
        pair.ours.apply_chat_template([messages])


def test_wrapped_transformers_tokenizer_matches(pair):
    """Directories the model store did not export go through AutoTokenizer and are wrapped."""
    wrapped = wrap_transformers(pair.reference)
    assert wrapped.transformers_source is pair.reference and to_transformers(wrapped) is pair.reference
    messages = template_messages(CONVERSATIONS["multi-turn"])
    for text in TEXTS:
        assert wrapped.encode(text) == pair.reference.encode(text)
    assert wrapped.apply_chat_template(messages, tools=TOOLS, return_dict=False) == \
        pair.reference.apply_chat_template(messages, tools=TOOLS, return_dict=False)
    assert wrapped.all_special_ids == pair.reference.all_special_ids
    assert wrapped.backend_tokenizer is not pair.reference.backend_tokenizer  # a copy


def test_to_transformers_builds_the_same_tokenizer(pair):
    hf = to_transformers(pair.ours)
    assert isinstance(hf, PreTrainedTokenizerFast) and hf.chat_template == pair.reference.chat_template
    for text in TEXTS:
        assert hf.encode(text) == pair.reference.encode(text)
    assert hf.all_special_ids == pair.reference.all_special_ids and len(hf) == len(pair.reference)
    messages = CONVERSATIONS["multi-turn"]
    assert hf.apply_chat_template(messages, return_dict=False) == \
        pair.ours.apply_chat_template(messages, return_dict=False)


def test_slow_and_python_overriding_tokenizers_are_refused(pair):
    with pytest.raises(ValueError, match="slow \\(Python\\) tokenizer: pagedllm needs a fast "
                                         "tokenizer, a tokenizer.json"):
        wrap_transformers(object())

    class Truncating(PreTrainedTokenizerFast):
        def decode(self, *args: Any, **kwargs: Any) -> str:
            return super().decode(*args, **kwargs)[:5]

    odd = Truncating(tokenizer_object=pair.reference.backend_tokenizer)
    with pytest.raises(ValueError, match="Truncating changes decode in Python"):
        wrap_transformers(odd)


def test_split_special_tokens_and_added_bos_follow_the_config(tmp_path: Path, pair):
    """tokenizer_config.json's split_special_tokens and add_bos/add_eos, as transformers reads
    them (the post-processor is rewritten)."""
    folder = ensure_model(pair.name)
    for name in ("tokenizer.json", "chat_template.jinja", ".tokenizer-export.json"):
        shutil.copy(folder / name, tmp_path / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(split_special_tokens=True, add_bos_token=True, add_eos_token=True,
                  clean_up_tokenization_spaces=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(tmp_path)
    ref = transformers_from_folder(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text)
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("x")[0] == ref.bos_token_id and ours.encode("x")[-1] == ref.eos_token_id
    assert to_transformers(ours).encode(TEXTS[12]) == ref.encode(TEXTS[12])
