"""A Lark grammar's rules, read for what every derivation must write (spelling.py's question).

Only the shape llguidance's Lark takes (its own lexer: JSON strings plus \\xHH, /regex/flags,
%json / %regex / %llguidance with a JSON value, <special> and @grammar references). Optional
parts (x? x* [x] x~0.. x{0,n}) are left out: they can always be skipped. Whatever is not
understood makes read_lark answer None, and its caller reads the grammar literally.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Union

_TOKEN = re.compile(r"""
    (?P<skip>(?:\#|//)[^\n]*|[ \t]+)
  | (?P<newline>(?:\r?\n)+[ \t]*)
  | (?P<string>"(?:\\.|[^"\\])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<json>%(?:json|regex|llguidance)\b)
  | (?P<directive>%[a-z]+)
  | (?P<opaque><[^<>\s]+>|@[a-zA-Z0-9_\-]+)
  | (?P<name>[!?]?[_a-zA-Z][_a-zA-Z0-9\-]*)
  | (?P<number>[+-]?[0-9]+)
  | (?P<punct>\.\.|->|[:|()\[\]{}~,.+*?=])
""", re.VERBOSE)
_BLANKS = re.compile(r"\s*")


@dataclass(frozen=True)
class Literal:
    """A "string" (case-insensitive with its i flag)."""

    text: str
    icase: bool


@dataclass(frozen=True)
class Pattern:
    """A /regex/ with its flags."""

    regex: str
    flags: str


@dataclass(frozen=True)
class Ref:
    """A rule or terminal by name."""

    name: str


@dataclass(frozen=True)
class Group:
    """( a | b ): alternatives, each a sequence of required items."""

    alternatives: tuple[tuple["Item", ...], ...]


@dataclass(frozen=True)
class Schema:
    """A %json {...} JSON schema, as its text."""

    json: str


@dataclass(frozen=True)
class Opaque:
    """Something this reader does not look into (%regex, <special>, "a".."z"): writable."""


Item = Union[Literal, Pattern, Ref, Group, Schema, Opaque]
_SKIPPABLE = Group(((),))  # [x]: one alternative writes nothing


def read_lark(text: str) -> Optional[dict[str, Group]]:
    """Each rule's (and terminal's) alternatives; None if the grammar is not understood."""
    tokens = _tokens(text)
    if tokens is None:
        return None
    rules: dict[str, Group] = {}
    for statement in _statements(tokens):
        if statement[0][0] in ("directive", "json"):
            if statement[0][1] == "%override":  # redefines a rule: not followed here
                return None
            continue  # %ignore, %import, %llguidance: nothing every output must hold
        reader = _Reader(statement)
        name = reader.head()
        body = reader.alternatives() if name is not None else None
        if body is None or not reader.done():
            return None
        rules[name] = body
    return rules


def _tokens(text: str) -> Optional[list[tuple[str, str]]]:
    """(kind, text) of each token, comments and blanks left out; None at one not known."""
    tokens, at = [], 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            return None
        kind, at = match.lastgroup, match.end()
        if kind == "json":  # its JSON value follows
            try:
                _, at = json.JSONDecoder().raw_decode(text, _BLANKS.match(text, at).end())
            except ValueError:
                return None
        if kind != "skip":
            tokens.append((kind, text[match.start():at]))
    return tokens


def _statements(tokens: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Tokens split at line ends, but for a line that goes on with | (Lark's continuation)."""
    statements: list[list[tuple[str, str]]] = [[]]
    for index, token in enumerate(tokens):
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if token[0] == "newline":
            if following != ("punct", "|") and statements[-1]:
                statements.append([])
        else:
            statements[-1].append(token)
    return [s for s in statements if s]


class _Reader:
    """A recursive descent over one statement: name [.priority] [params]: alternatives."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self._tokens, self._at = tokens, 0

    def _peek(self) -> tuple[str, str]:
        return self._tokens[self._at] if self._at < len(self._tokens) else ("end", "")

    def _take(self, value: str) -> bool:
        if self._peek()[1] != value:
            return False
        self._at += 1
        return True

    def done(self) -> bool:
        return self._at == len(self._tokens)

    def head(self) -> Optional[str]:
        kind, name = self._peek()
        if kind != "name":
            return None
        self._at += 1
        if self._take("."):
            self._at += 1  # the priority
        if self._take("["):  # parameters (lazy, max_tokens=...)
            while not self._take("]"):
                if self.done():
                    return None
                self._at += 1
        return name.lstrip("!?") if self._take(":") else None

    def alternatives(self) -> Optional[Group]:
        alternatives = []
        while True:
            sequence = self._sequence()
            if sequence is None:
                return None
            alternatives.append(sequence)
            if not self._take("|"):
                return Group(tuple(alternatives))

    def _sequence(self) -> Optional[tuple[Item, ...]]:
        items: list[Item] = []
        while self._peek()[1] not in ("|", ")", "]", "->", ""):
            item = self._atom()
            if item is None:
                return None
            if self._required() and item != _SKIPPABLE:
                items.append(item)
        if self._take("->"):  # an alias names the tree node; nothing to write
            self._at += 1
        return tuple(items)

    def _atom(self) -> Optional[Item]:
        kind, value = self._peek()
        self._at += 1
        if kind == "string":
            text = _string(value.removesuffix("i"))
            if text is not None and self._take(".."):  # "a".."z": a range
                self._at += 1
                return Opaque()
            return None if text is None else Literal(text, value.endswith("i"))
        if kind == "regex":
            body, _, flags = value[1:].rpartition("/")
            return Pattern(body, flags)
        if kind == "name":
            return Ref(value)
        if value.startswith("%json"):
            return Schema(value.removeprefix("%json").strip())
        if kind in ("json", "opaque"):
            return Opaque()
        if value in ("(", "["):
            group = self.alternatives()
            if group is None or not self._take(")" if value == "(" else "]"):
                return None
            return group if value == "(" else _SKIPPABLE
        return None

    def _required(self) -> bool:
        """Read the repetition after an item; whether the item must occur at least once."""
        if self._take("?") or self._take("*"):
            return False
        if self._take("+"):
            return True
        if self._take("~"):
            low = self._peek()[1]
            self._at += 1
            if self._take(".."):
                self._at += 1
            return low != "0"
        if self._take("{"):
            low = self._peek()[1]
            while not self._take("}") and not self.done():
                self._at += 1
            return low not in ("0", ",")
        return True


def _string(literal: str) -> Optional[str]:
    """A Lark string's text: JSON's escapes and \\xHH (llguidance's lexer takes both)."""
    as_json = re.sub(r"\\(x([0-9a-fA-F]{2})|.)",
                     lambda m: "\\u00" + m.group(2) if m.group(2) else m.group(0), literal)
    try:
        return json.loads(as_json)
    except ValueError:
        return None
