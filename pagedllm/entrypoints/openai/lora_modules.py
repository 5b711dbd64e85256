"""--lora-modules: the LoRA adapters a server serves, each by its name in a request's `model`
(vLLM's two forms: name=path, or JSON {"name", "path", "base_model_name"})."""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from pagedllm.lora.request import LoRARequest

_JSON_KEYS = ("name", "path", "base_model_name")


def parse_lora_module(text: str, lora_int_id: int) -> LoRARequest:
    """One --lora-modules value as a LoRARequest with this id; a ValueError naming the flag."""
    where = f"--lora-modules {text!r}"
    if text.lstrip().startswith("{"):
        try:
            raw: Any = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{where}: not valid JSON ({err})") from None
        unknown = sorted(set(raw) - set(_JSON_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: {', '.join(_JSON_KEYS)}")
        name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"{where}: give name=path or a JSON object with name and path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"{where}: the adapter needs a non-empty name and path")
    return LoRARequest(name, lora_int_id, path, base)


def lora_modules(values: Optional[Sequence[str]], enable_lora: bool,
                 served_name: str) -> dict[str, LoRARequest]:
    """name -> LoRARequest of every --lora-modules value (ids 1, 2, ... in order); a ValueError
    without --enable-lora, or for a name given twice or taken by the served model."""
    if not values:
        return {}
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    out: dict[str, LoRARequest] = {}
    for i, text in enumerate(values, start=1):
        request = parse_lora_module(text, i)
        if request.lora_name in out or request.lora_name == served_name:
            raise ValueError(f"--lora-modules: the name {request.lora_name!r} is already served; "
                             "each adapter needs its own name")
        out[request.lora_name] = request
    return out


def model_cards(base_name: str, adapters: dict[str, LoRARequest],
                card: dict[str, Any]) -> list[dict[str, Any]]:
    """/v1/models' entries: the base model, then each adapter with its `parent` (the model it
    adapts) and `root` (its path), as vLLM lists them."""
    cards = [{**card, "id": base_name, "root": base_name, "parent": None}]
    for name, request in adapters.items():
        cards.append({**card, "id": name, "root": request.lora_path,
                      "parent": request.base_model_name or base_name})
    return cards
