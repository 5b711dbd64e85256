"""Chat templates rendered as transformers 5.24 renders them (its utils/chat_template_utils.py):
the same sandboxed jinja environment, template variables, message clean-up and
continue_final_message rules, without importing transformers.

Not offered (refused by FastTokenizer.apply_chat_template): tools given as Python functions
(transformers turns their signature and docstring into a JSON schema), batches of conversations,
assistant-token masks and control-token sanitizing.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Union

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# appended to the message to continue, then cut from the render with what follows it
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# names a message's reasoning is passed under; templates read the first
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# older jinja2 has known sandbox escapes, and chat templates are untrusted code
_MIN_JINJA = (3, 1, 6)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks assistant text with it (for
    assistant-token masks, not offered here); the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &, ') that a prompt must keep as written
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without the attributes of the dict class itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute.")


@lru_cache
def compile_template(source: str) -> jinja2.Template:
    """The compiled template, in transformers' environment (cached per template text)."""
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); this is "
                          f"{jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(source)


def _as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models), nested ones too, as dicts."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def normalize_messages(conversation: Any) -> list[dict]:
    """The messages as dicts without their None values (templates crash or print "None" on
    `content=None`, but handle a missing key); TypeError for a message that is not a dict."""
    out = []
    for message in _as_dicts(getattr(conversation, "messages", conversation)):
        if not isinstance(message, dict):
            raise TypeError("Chat messages should be dicts, dataclasses or pydantic models, but "
                            f"got {message!r}.")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def plain_data(value: Any) -> Any:
    """value rebuilt from plain JSON types, anything else an inert "<TypeName>": the sandbox does
    not know which methods of rich objects are dangerous."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy strings) carry extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
        return plain_data(value.item())  # np.bool_(False) must not become a truthy placeholder
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """reasoning_content filled from older names for it, and `thinking` for templates that
    read that one."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict], field: str, template: str) -> str:
    """Append the continue tag to the final message's `field`; return the text to continue."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" '
                         "to continue!")
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted '
                         "field in the chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):  # the last text block is the one continued
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to "
                         "continue in the final message!")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    """The render up to the continued text's end (the tag and all after it dropped)."""
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message in "
            "your chat to ensure they are compatible."
            f"Final message to continue: {final.strip()}\nRendered chat:\n{rendered}")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render_chat_template(template: str, conversation: Any, *, tools: Any = None,
                         documents: Any = None, add_generation_prompt: bool = False,
                         continue_final_message: Union[bool, str] = False,
                         variables: Mapping[str, Any]) -> str:
    """One conversation through template, with transformers' checks and their error classes;
    variables are the other template variables (special tokens, chat_template_kwargs)."""
    if isinstance(conversation, (list, tuple)) and not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least "
                         "one message.")
    if isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")):
        raise ValueError("conversation must be one conversation (a list of messages); batches "
                         "of conversations are not supported")
    chat = normalize_messages(conversation)
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, and "
            "add_generation_prompt when you want to add a header that will prompt it to start a "
            "new assistant message instead.")
    compiled = compile_template(template)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts); Python functions as tools are not "
                         "supported")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _alias_reasoning(plain_data(chat))
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, field, template)
    rendered = compiled.render(messages=chat, tools=plain_data(tools),
                               documents=plain_data(documents),
                               add_generation_prompt=add_generation_prompt,
                               **plain_data(dict(variables)))
    return rendered if final is None else _cut_at_tag(rendered, final)
