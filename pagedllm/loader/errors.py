"""ModelFileError: the one error for a model file that cannot be what it claims to be."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelFileError(ValueError):
    """A model file (GGUF, safetensors, config.json) that is truncated, corrupt or describes an
    impossible model; the message names the file and what is wrong, on one line."""


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, an index) as a dict, or ModelFileError naming it."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ModelFileError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
