"""A constraint's cache key and size, and the caps checked before the grammar compiler sees it.

The key is a hash of the constraint as the request sent it (kind, options, value), so a cache
hit costs one hash: no schema-to-grammar conversion. Each refusal is a ValueError that starts
with the request's field and names the cap and its flag (the server answers it with a 400).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams

# serde_json's nesting limit, which llguidance reads schemas with: a deeper one is refused there
MAX_SCHEMA_DEPTH = 128
# a rule definition: Lark `name:` / `?name.2:` / `NAME:`, GBNF `name ::=`, at a line's start
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)


@dataclass(frozen=True)
class SpecKey:
    """A constraint's cache key and its size in bytes as sent."""

    digest: str
    num_bytes: int


def _cap_error(params: StructuredOutputsParams, what: str, cap: str, limit: int) -> ValueError:
    flag = "--" + cap.replace("_", "-")
    return ValueError(f"{params.label} {what}; at most {limit} are allowed ({cap}, {flag}): "
                      "send a smaller constraint, or start the engine with a larger limit")


def _schema_text(params: StructuredOutputsParams, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise ValueError(f"{params.label} is not a valid json: {err}") from None


def _value_text(params: StructuredOutputsParams) -> str:
    """The constraint's value as one string (what is hashed and measured)."""
    value = getattr(params, params.kind)
    if params.kind == "json":
        return _schema_text(params, value)
    if params.kind == "choice":
        return json.dumps(list(value), ensure_ascii=False)
    return value if isinstance(value, str) else json.dumps(value)


def spec_key(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> SpecKey:
    """Hash the constraint; ValueError if it is over the byte or choice cap, or (a schema given
    as an object) over the node or depth cap, which are walked before it is serialized."""
    if params.kind == "choice" and len(params.choice) > config.max_guided_choices:
        raise _cap_error(params, f"has {len(params.choice)} choices", "max_guided_choices",
                         config.max_guided_choices)
    if params.kind == "json" and isinstance(params.json, dict):
        check_schema_shape(params, params.json, config)
    text = _value_text(params)
    num_bytes = len(text.encode("utf-8", "surrogatepass"))
    if num_bytes > config.max_grammar_bytes:
        raise _cap_error(params, f"is {num_bytes} bytes", "max_grammar_bytes",
                         config.max_grammar_bytes)
    options = (params.kind, params.disable_any_whitespace, params.disable_additional_properties,
               params.whitespace_pattern)
    digest = hashlib.sha256(repr(options).encode() + b"\0" + text.encode("utf-8", "surrogatepass"))
    return SpecKey(digest.hexdigest(), num_bytes)


def check_spec(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
    """The caps that need the spec parsed (a cache miss only): a grammar's rule count, a
    schema sent as text's node count and depth."""
    if params.kind == "grammar":
        rules = len(_RULE.findall(params.grammar))
        if rules > config.max_grammar_rules:
            raise _cap_error(params, f"has {rules} rules", "max_grammar_rules",
                             config.max_grammar_rules)
    elif params.kind == "json" and isinstance(params.json, str):
        try:
            schema = json.loads(params.json)
        except (ValueError, RecursionError) as err:
            raise ValueError(f"{params.label} is not a valid json: {err}") from None
        check_schema_shape(params, schema, config)


def check_schema_shape(params: StructuredOutputsParams, schema: Any,
                       config: StructuredOutputsConfig) -> None:
    """Count a schema's objects and arrays and its depth without recursing (a hostile schema
    may nest deeper than Python's stack), stopping at the first cap passed."""
    stack, nodes = [(schema, 1)], 0
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        nodes += 1
        if nodes > config.max_json_schema_nodes:
            raise _cap_error(params, "has more objects and arrays", "max_json_schema_nodes",
                             config.max_json_schema_nodes)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{params.label} nests deeper than {MAX_SCHEMA_DEPTH} levels "
                             "(the grammar engine's limit)")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
