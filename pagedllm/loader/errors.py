"""ModelFileError: the one error for a model file that cannot be what it claims to be."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class ModelFileError(ValueError):
    """A model file (GGUF, safetensors, config.json) that is truncated, corrupt or describes an
    impossible model; the message names the file and what is wrong, on one line."""


class NotBuildable(Exception):
    """A GGUF's tokenizer is of a kind pagedllm does not build exactly from its metadata (it is
    left to transformers' converter); the text says why."""


@contextmanager
def building_tokenizer(source: str | Path, keys: str) -> Iterator[None]:
    """The tokenizers library's (or transformers') errors while building a tokenizer from keys,
    as one ModelFileError naming the file and the keys (theirs name neither)."""
    try:
        yield
    except (NotBuildable, ModelFileError, MemoryError, ImportError):
        raise  # ours already name the file; the last two are not the file's fault
    except Exception as err:  # tokenizers raises plain Exception; transformers anything
        raise ModelFileError(f"{source}: the tokenizer could not be built from {keys}: "
                             f"{type(err).__name__}: {err}") from err


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, an index) as a dict, or ModelFileError naming it."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ModelFileError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
