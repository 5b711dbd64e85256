"""The Lark reader behind the spelling check: required items kept, optional ones left out,
and None for what it does not follow."""
from __future__ import annotations

from pagedllm.structured_output.lark_reader import (Group, Literal, Opaque, Pattern, Ref,
                                                    Schema, read_lark)


def test_rules_alternatives_and_repetitions():
    rules = read_lark('%llguidance {"a": {"b": 1}}\n// a comment\n'
                      'start: "a"i x+ [y] y? y* y~0..2 y{0,3} (y | "\\x04") -> alias\n'
                      '     | /b+/s X~2 X{1,} %json {"type": "string"} <|end|> "a".."z"\n'
                      'x.2[lazy]: "\\u0006"\n'
                      'X: y\n%ignore /[ ]/\n%import common.WS')
    assert rules == {
        "start": Group(((Literal("a", True), Ref("x"),
                         Group(((Ref("y"),), (Literal("\x04", False),)))),
                        (Pattern("b+", "s"), Ref("X"), Ref("X"), Schema('{"type": "string"}'), Opaque(),
                         Opaque()))),
        "x": Group(((Literal("\x06", False),),)),
        "X": Group(((Ref("y"),),)),
    }


def test_what_the_reader_does_not_follow_is_none():
    assert read_lark('%override x: "a"\nstart: x') is None
    assert read_lark('start: ("a"\n  "b")') is None  # a group over two lines
    assert read_lark('start: "a" ^') is None
    assert read_lark('start: "\\q"') is None  # not an escape llguidance's strings take
