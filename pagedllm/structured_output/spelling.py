"""Characters a constraint needs that the model's vocabulary cannot write, found before it runs.

A byte-level BPE trained without the full byte alphabet has no token for some bytes (SmolLM2:
six control characters and the lead bytes 0xF1/0xF2 of planes 4-11). A constraint that needs
such a byte makes llguidance force it, find no token, and stop the request mid-way; so it is
refused at compile time instead, naming the field and the character.

What "needs" means here: every output the constraint allows holds the character (a required
literal; a class or alternation all of whose options are unwritable). A constraint with one
writable way through is kept, even where another way leads to a dead end (`(a\\x04|b)`: the
model may write "a" and then be stopped): refusing it would refuse something satisfiable.
Regexes (the regex itself, a grammar's /terminals/, a JSON schema's pattern) are read with
Python's regex parser after turning the escapes only Rust's regex takes (`\\x{..}`, `\\u{..}`,
`\\U{..}`, `\\p{..}`) into Python's; one it cannot read falls back to its literal characters.
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, NamedTuple, Optional

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.lark_reader import (Group, Item, Literal, Pattern, Ref,
                                                    Schema, read_lark)

try:  # re.compile's parser and its opcodes: private (any failure of the parser is caught), and
    import re._constants as sre_constants  # so named from Python 3.11 on
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

BRANCH, IN, LITERAL, RANGE, SUBPATTERN = (sre_constants.BRANCH, sre_constants.IN,
                                          sre_constants.LITERAL, sre_constants.RANGE,
                                          sre_constants.SUBPATTERN)
SRE_FLAG_IGNORECASE = sre_constants.SRE_FLAG_IGNORECASE
# (?>...) and x*+ came with Python 3.11: None (no node is) where the parser has neither
ATOMIC_GROUP = getattr(sre_constants, "ATOMIC_GROUP", None)
REPEATS = tuple(op for op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
                              getattr(sre_constants, "POSSESSIVE_REPEAT", None)) if op is not None)

# Rust-only spellings, turned into Python's: \x{HEX} \u{HEX} \U{HEX}; \p{..} / \pL (a Unicode
# class: it always has writable members, so a writable stand-in); \z; a (?<name>...) group.
# Escapes Rust refuses but Python decodes (\0, \1.., \N{..}) make the regex unreadable:
# llguidance refuses it anyway
_RUST_ONLY = re.compile(r"\\(?:([xuU])\{([0-9a-fA-F]{1,8})\}|([pP])(?:\{[^}]*\}|[A-Za-z])|(.))"
                          r"|(\(\?<)(?=[A-Za-z_])", re.DOTALL)


class Needed(NamedTuple):
    """A character the constraint holds that the vocabulary cannot write."""

    char: str
    unavoidable: bool  # every output needs it (a regex or grammar, read for its structure)


@dataclass(frozen=True)
class Spelling:
    """What a model's vocabulary can write: the bytes some token holds."""

    spellable: frozenset[int]
    escapes_controls: bool = False  # inside JSON strings: controls are written as \\u escapes

    def writes(self, char: str) -> bool:
        """Whether some token sequence writes char (all its UTF-8 bytes are in tokens)."""
        return self.first_writable(ord(char), ord(char)) is not None

    def missing(self, char: str) -> int:
        """The first byte of char that no token holds."""
        return next(b for b in char.encode("utf-8", "surrogatepass") if b not in self.spellable)

    def first_writable(self, low: int, high: int) -> Optional[int]:
        """The first code point in [low, high] the vocabulary writes, skipping each run that
        shares a missing byte (a missing lead byte skips its whole block: 2^18 code points)."""
        code = low
        while code <= high:
            if self.escapes_controls and (code < 0x20 or code == 0x7F):
                return code
            encoded = chr(code).encode("utf-8", "surrogatepass")
            bad = next((i for i, b in enumerate(encoded) if b not in self.spellable), None)
            if bad is None:
                return code
            shift = 6 * (len(encoded) - 1 - bad)  # the bits below the missing byte
            code = ((code >> shift) + 1) << shift
        return None


def spellable_bytes(tokenizer: llguidance.LLTokenizer) -> frozenset[int]:
    """The bytes that occur in some token: what the model can write at all. A byte-level BPE
    trained without the full byte alphabet lacks some (SmolLM2: six control characters and
    the lead bytes 0xF1/0xF2 of planes 4-11, besides the bytes UTF-8 never uses); ~20 ms for
    a 49k vocabulary."""
    seen: set[int] = set()
    for token in range(tokenizer.vocab_size):
        seen.update(tokenizer.decode_bytes([token]))
    return frozenset(seen)


def check_spellable(params: StructuredOutputsParams, spellable: frozenset[int]) -> None:
    """ValueError naming the field when the constraint needs a character the model cannot write
    (one of its UTF-8 bytes is in no token), written out or as an escape: a choice, a regex,
    a grammar's literals and /terminals/, a schema's strings and patterns. The grammar engine
    would force that byte and fail mid-request."""
    spelling = Spelling(spellable)
    found = needed(params, spelling)
    if found is None:
        return
    char = found.char
    why = ("; every output the constraint allows needs it (or another character the vocabulary "
           "cannot write)" if found.unavoidable else "")
    raise ValueError(
        f"{params.label} holds {char!r} (U+{ord(char):04X}), which this model's vocabulary "
        f"cannot write: no token holds the byte 0x{spelling.missing(char):02X}{why}; leave "
        "the character out of the constraint")


def needed(params: StructuredOutputsParams, spelling: Spelling) -> Optional[Needed]:
    """The unwritable character the constraint holds (read for its structure where it can be)."""
    kind, value = params.kind, getattr(params, params.kind)
    if kind == "regex":
        return regex_needs(value, spelling)
    if kind == "grammar":
        return grammar_needs(value, spelling)
    if kind == "json" and isinstance(value, str):
        value = json.loads(value)  # grammar_text has read it: escapes such as \\u0004 decoded
    if kind == "json":
        return _schema_needs(value, replace(spelling, escapes_controls=True))
    return _first_literal(value, spelling)


def grammar_needs(grammar: str, spelling: Spelling) -> Optional[Needed]:
    """The unwritable character every output of a Lark (or GBNF) grammar holds. The rules that
    can write something writable are found from the leaves up: a rule found so makes its users
    worth another look. A grammar the reader does not follow is read literally."""
    try:
        rules = read_lark(any_to_lark(grammar))
    except Exception:  # as llguidance's grammar_from catches (grammar_text has refused those)
        rules = None
    if rules is None or "start" not in rules:
        return _literal(grammar, spelling)
    leaves: dict[Item, Optional[str]] = {}
    writable: set[str] = set()

    def needs(item: Item) -> bool:  # whether item cannot be written with writable characters
        if isinstance(item, Ref):
            return item.name in rules and item.name not in writable
        if isinstance(item, Group):
            return all(any(needs(i) for i in sequence) for sequence in item.alternatives)
        if item not in leaves:
            leaves[item] = _leaf(item, spelling)
        return leaves[item] is not None

    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, body in rules.items():
        for used in _refs(body):
            users.get(used, set()).add(name)
    waiting = list(rules)
    while waiting:
        name = waiting.pop()
        if name not in writable and not needs(rules[name]):
            writable.add(name)
            waiting.extend(users[name] - writable)
    if "start" in writable:
        return None
    char = _culprit(rules["start"], rules, needs, leaves)
    return None if char is None else Needed(char, True)


def _refs(group: Group) -> Iterable[str]:
    """The names a rule's body refers to."""
    stack: list[Item] = [group]
    while stack:
        item = stack.pop()
        if isinstance(item, Ref):
            yield item.name
        elif isinstance(item, Group):
            stack.extend(part for sequence in item.alternatives for part in sequence)


def _leaf(item: Item, spelling: Spelling) -> Optional[str]:
    """The unwritable character a literal, a /regex/ or a %json schema needs."""
    if isinstance(item, Literal):
        return next((c for c in item.text if _char(c, spelling, item.icase)), None)
    if isinstance(item, Pattern):
        flags = "".join(f for f in item.flags if f in "imsx")
        found = regex_needs(f"(?{flags}){item.regex}" if flags else item.regex, spelling)
        return None if found is None else found.char
    if isinstance(item, Schema):
        found = _schema_needs(json.loads(item.json), replace(spelling, escapes_controls=True))
        return None if found is None else found.char
    return None  # Opaque


def _culprit(start: Group, rules: dict[str, Group], needs: Callable[[Item], bool],
             leaves: dict[Item, Optional[str]]) -> Optional[str]:
    """The first unwritable character found down the parts of start that need one."""
    stack: list[Item] = [start]
    seen: set[str] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, Ref) and item.name not in seen:
            seen.add(item.name)
            stack.append(rules[item.name])
        elif isinstance(item, Group):
            stack.extend(reversed([part for sequence in item.alternatives
                                   for part in sequence if needs(part)]))
        elif not isinstance(item, Ref) and leaves.get(item) is not None:
            return leaves[item]
    return None


def _literal(text: str, spelling: Spelling, unavoidable: bool = False) -> Optional[Needed]:
    """The first character of text the vocabulary cannot write."""
    if spelling.spellable.issuperset(text.encode("utf-8", "surrogatepass")):
        return None  # the common case, in C: 100,000 choices 0.05 s, not 0.5
    char = next((c for c in dict.fromkeys(text) if not spelling.writes(c)), None)
    return None if char is None else Needed(char, unavoidable)


def _schema_needs(value: Any, spelling: Spelling) -> Optional[Needed]:
    """A JSON schema's strings read literally (a const or enum value all through), its
    patterns as regexes. Recursion is bounded: a schema object is held to MAX_SCHEMA_DEPTH by
    spec_key before a compile."""
    if not isinstance(value, dict):
        return _first_literal(value, spelling)
    for key, item in value.items():
        if key == "pattern" and isinstance(item, str):
            found = regex_needs(item, spelling)
        elif key in ("const", "enum"):
            found = _first_literal(item, spelling)
        else:  # a key that is not a string (offline: a Python dict) is written as one
            found = _literal(str(key), spelling) or _schema_needs(item, spelling)
        if found is not None:
            return found
    return None


def _first_literal(value: Any, spelling: Spelling) -> Optional[Needed]:
    """The first unwritable character of the strings in value."""
    return next(filter(None, (_literal(text, spelling) for text in _strings(value))), None)


def _strings(value: Any) -> Iterable[str]:
    """Every string in a constraint's value (a schema's keys and values included). Not
    spec_caps' _value_text: its json.dumps writes control characters as \\u escapes."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def regex_needs(pattern: str, spelling: Spelling) -> Optional[Needed]:
    """The unwritable character every match of pattern holds; None if a match can avoid them
    all. A regex Python cannot read is read literally."""
    python = _python_regex(pattern)
    try:
        if python is None:
            raise ValueError("an escape Rust's regex refuses")
        with warnings.catch_warnings():  # Rust's [[:alpha:]] and && read as literals here
            warnings.simplefilter("ignore")
            parsed = sre_parse.parse(python)
    except (re.error, RecursionError, OverflowError, ValueError):
        return _literal(pattern, spelling)
    char = _sequence(list(parsed), spelling, bool(parsed.state.flags & SRE_FLAG_IGNORECASE))
    return None if char is None else Needed(char, True)


def _python_regex(pattern: str) -> Optional[str]:
    """pattern in Python's spelling; None if it holds an escape Rust refuses."""
    refused = False

    def python(match: re.Match) -> str:
        nonlocal refused
        kind, digits, unicode_class, other, named = match.groups()
        if named is not None:
            return "(?P<"
        if kind is not None:
            code = int(digits, 16)
            refused |= code > 0x10FFFF
            return f"\\U{code:08x}" if code <= 0x10FFFF else match.group(0)
        if unicode_class is not None:
            return "\\w"
        refused |= other.isdigit() or other == "N"
        return "\\Z" if other == "z" else match.group(0)

    converted = _RUST_ONLY.sub(python, pattern)
    return None if refused else converted


def _sequence(items: list, spelling: Spelling, icase: bool) -> Optional[str]:
    """The first unwritable character a run of regex nodes cannot avoid."""
    for op, arg in items:
        char = _node(op, arg, spelling, icase)
        if char is not None:
            return char
    return None


def _node(op: Any, arg: Any, spelling: Spelling, icase: bool) -> Optional[str]:
    if op is LITERAL:
        return _char(chr(arg), spelling, icase)
    if op is IN:
        return _class(arg, spelling, icase)
    if op is BRANCH:  # every alternative needs one: the first one's names it
        chars = [_sequence(list(branch), spelling, icase) for branch in arg[1]]
        return chars[0] if all(chars) else None
    if op is SUBPATTERN:
        _, add_flags, del_flags, sub = arg
        icase = bool((icase or add_flags & SRE_FLAG_IGNORECASE)
                     and not del_flags & SRE_FLAG_IGNORECASE)
        return _sequence(list(sub), spelling, icase)
    if op in REPEATS:
        low, _, sub = arg
        return _sequence(list(sub), spelling, icase) if low >= 1 else None
    if ATOMIC_GROUP is not None and op is ATOMIC_GROUP:
        return _sequence(list(arg), spelling, icase)
    return None  # ., \d, anchors, a negated class...: writable choices, or nothing to write


def _char(char: str, spelling: Spelling, icase: bool) -> Optional[str]:
    """char if it (and, case-insensitive, each of its cases) is unwritable."""
    cases = {char, char.lower(), char.upper()} if icase else {char}  # "İ".lower() is 2 chars
    return None if any(all(map(spelling.writes, case)) for case in cases) else char


def _class(items: list, spelling: Spelling, icase: bool) -> Optional[str]:
    """The class's first character if none of its members is writable."""
    first = None
    for op, arg in items:
        if op is LITERAL:
            char = _char(chr(arg), spelling, icase)
        elif op is RANGE and not icase:
            char = chr(arg[0]) if spelling.first_writable(*arg) is None else None
        else:  # negated, a category (\w \s \d), a case-insensitive range: writable members
            return None
        if char is None:
            return None
        first = first or char
    return first
