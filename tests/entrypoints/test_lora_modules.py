"""--lora-modules: vLLM's name=path and JSON forms, ids in order, refusals naming the flag, and
/v1/models' cards with parent and root."""
from __future__ import annotations

import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.lora_modules import lora_modules, model_cards
from pagedllm.lora.request import LoRARequest


def test_both_forms_parse_in_order_with_ids_from_one():
    args = build_parser().parse_args([
        "serve", "m", "--enable-lora", "--lora-modules", "sql=/a/sql",
        '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}',
        "--lora-modules", "code=/a/code"])
    got = lora_modules(args.lora_modules, args.enable_lora, "m")
    assert got == {"sql": LoRARequest("sql", 1, "/a/sql"),
                   "chat": LoRARequest("chat", 2, "/a/chat", "base"),
                   "code": LoRARequest("code", 3, "/a/code")}
    assert lora_modules(None, False, "m") == {}


@pytest.mark.parametrize("values, enable, match", [
    (["a=/p"], False, "--lora-modules needs --enable-lora"),
    (["a"], True, "give name=path or a JSON object"),
    (["{bad"], True, "not valid JSON"),
    (['{"name": "a", "path": "/p", "rank": 8}'], True, "unknown keys \\['rank'\\]"),
    (["=/p"], True, "needs a non-empty name and path"),
    (["a=/p", "a=/q"], True, "the name 'a' is already served"),
    (["m=/p"], True, "the name 'm' is already served")])
def test_bad_values_are_refused_naming_the_flag(values, enable, match):
    with pytest.raises(ValueError, match=match):
        lora_modules(values, enable, "m")


def test_model_cards_list_adapters_with_parent_and_root():
    adapters = {"sql": LoRARequest("sql", 1, "/a/sql"),
                "chat": LoRARequest("chat", 2, "/a/chat", "other")}
    cards = model_cards("m", adapters, {"object": "model"})
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("m", "m", None), ("sql", "/a/sql", "m"), ("chat", "/a/chat", "other")]
