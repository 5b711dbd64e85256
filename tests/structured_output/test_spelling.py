"""What a vocabulary can write and what a regex or grammar cannot avoid, on a byte set like
SmolLM2's (its tokenizer's own set is tested through the compiler in test_grammar.py)."""
from __future__ import annotations

import pytest

from pagedllm.sampling_params import StructuredOutputsParams as SO
from pagedllm.structured_output.spelling import (Needed, Spelling, grammar_needs,
                                                 needed, regex_needs)

# SmolLM2's missing bytes, with those UTF-8 never uses
MISSING = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2, 0xC0, 0xC1, *range(0xF5, 0x100)}
SPELLING = Spelling(frozenset(set(range(256)) - MISSING))


def test_first_writable_skips_the_blocks_of_a_missing_byte():
    assert SPELLING.first_writable(0x80000, 0xBFFFF) is None  # all of lead bytes 0xF1, 0xF2
    assert SPELLING.first_writable(0x40000, 0xC0000) == 0xC0000
    assert SPELLING.first_writable(0x04, 0x06) == 0x05
    assert not SPELLING.writes("\x04") and SPELLING.writes("\u00f2") and SPELLING.writes("\u4e2d")
    in_json = Spelling(SPELLING.spellable, escapes_controls=True)  # written as \u0004
    assert in_json.writes("\x04") and not in_json.writes("\U000b7105")


@pytest.mark.parametrize("pattern,char", [
    (r"a\x04b", "\x04"),
    (r"a\x{4}b|c\u{6}", "\x04"),  # every branch needs one: the first names it
    (r"(?i)a\x{b7105}", "\U000b7105"),
    (r"[\x04\x06]{2,}", "\x04"),
    (r"(?:\x04|\x06)++", "\x04"),
    (r"\pL\P{Lu}\x04", "\x04"),  # a Unicode class is writable; the \x04 after it is not
    ("a\x04b", "\x04"),  # written out
    (r"(?<name>a|\x{6})\x04[(?<]", "\x04"),  # Rust's named group
    (r"a\x04|b", None),
    (r"a\x04{0,3}", None),
    (r"[^a]\x{41}", None),  # a negated class has writable members
    (r"(?i)\u0130x", None),  # U+0130's lower case is two characters
    (r"\x{110000}\x04", None),  # past Unicode: llguidance refuses it, not this
    (r"a\004", None),  # octal is an escape Rust refuses: llguidance's own error
])
def test_regex_needs_what_no_match_can_avoid(pattern, char):
    assert regex_needs(pattern, SPELLING) == (None if char is None else Needed(char, True))


def test_a_regex_python_cannot_read_is_read_literally():
    assert regex_needs("(?U)a\U000b7105|b", SPELLING) == Needed("\U000b7105", False)
    assert regex_needs(r"(?U)a\x04", SPELLING) is None  # its escapes are not seen then


def test_grammars_are_refused_only_when_start_needs_the_character():
    chain = "".join(f'r{i}: "x" r{i + 1} | "y" r{i + 1}\n' for i in range(3000))
    assert grammar_needs("start: r0\n" + chain + 'r3000: "\\x04"', SPELLING) == \
        Needed("\x04", True)  # a long chain: no recursion limit on the way
    assert grammar_needs("start: r0\n" + chain + 'r3000: "\\x04" | "z"', SPELLING) is None
    assert grammar_needs('start: a | b\na: "\\x04"\nb: a "c"', SPELLING) == Needed("\x04", True)
    assert grammar_needs('start: a\na: "b" a | "\\x06"i', SPELLING) == Needed("\x06", True)
    assert grammar_needs('start: /[\\x04-\\x06]/', SPELLING) is None  # 0x05 is writable
    # a grammar the reader does not follow is read literally
    assert grammar_needs('%override x: "\\x04"\nstart: "\U000b7105"', SPELLING) == \
        Needed("\U000b7105", False)


def test_a_schema_is_read_with_its_patterns_and_json_escapes():
    def needs(schema):
        return needed(SO(json=schema), SPELLING)

    assert needs({"type": "string", "pattern": "^(\U000b7105|a)$"}) is None
    assert needs({"type": "string", "pattern": "^a\\x{4}", "const": "a\x04"}) is None
    assert needs({1: {"pattern": "^\\U000b7105"}}) == Needed("\U000b7105", True)
    assert needs({"const": {"pattern": "a|\U000b7105"}}) == Needed("\U000b7105", False)
