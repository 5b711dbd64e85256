"""Chat templates: from the model, overridden by --chat-template, a clear 400 without one."""
from __future__ import annotations

import copy
from functools import partial
from types import SimpleNamespace

import pytest

from pagedllm.tokenizer.chat_messages import render_chat
from pagedllm.entrypoints.openai.api_server import load_chat_template
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import chat_prompt_ids
from pagedllm.entrypoints.openai.serving_common import OpenAIError, ServerContext
from pagedllm.tokenizer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    return load_tokenizer(smollm_gguf.parent)


def _ctx(tokenizer, template=None):
    # the engine's chat path (tokenizer/chat_messages.render_chat) without loading a model
    engine = SimpleNamespace(tokenizer=tokenizer, chat_prompt_ids=partial(render_chat, tokenizer))
    return ServerContext(engine, ["m"], 2048, template)


REQ = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])


def test_model_template_and_override(tokenizer, tmp_path):
    ids = chat_prompt_ids(_ctx(tokenizer), REQ)
    assert tokenizer.decode(ids).startswith("<|im_start|>")
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    ids = chat_prompt_ids(_ctx(tokenizer, load_chat_template(str(path))), REQ)
    assert tokenizer.decode(ids) == "user: Hi\n"


def test_no_template_is_a_400(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(OpenAIError, match="this model has none.*--chat-template") as err:
        chat_prompt_ids(_ctx(bare), REQ)
    assert err.value.status == 400 and err.value.param == "messages"


def test_missing_template_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--chat-template .*no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
