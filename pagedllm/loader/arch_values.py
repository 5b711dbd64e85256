"""Checked reads of a checkpoint's architecture numbers (GGUF metadata or config.json fields).

A value that would divide by zero (head_count 0), size tensors without bound (hidden size 2^40)
or poison every activation (rms epsilon NaN) is refused with a ModelFileError naming the
field, what is allowed and the file, e.g. "llama.attention.head_count must be >= 1, got 0 in
model.gguf".
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pagedllm.config import ModelArchConfig
from pagedllm.loader.errors import ModelFileError

# Largest dimension or count accepted: int32 (the kernels index with it; no real model is near).
MAX_DIMENSION = 2**31 - 1


def _integer(value: Any, key: str, source: str | Path) -> int:
    """value as an int (an integral float is fine), or ModelFileError."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(f"{key} must be an integer, got {value!r} in {source}")
    return value


def dimension(value: Any, key: str, source: str | Path) -> int:
    """A size or count: an integer in [1, MAX_DIMENSION]."""
    n = _integer(value, key, source)
    if not 1 <= n <= MAX_DIMENSION:
        raise ModelFileError(f"{key} must be >= 1 and <= {MAX_DIMENSION}, got {n} in {source}")
    return n


def token_id(value: Any, key: str, source: str | Path) -> int:
    """A token id: an integer in [0, MAX_DIMENSION]."""
    n = _integer(value, key, source)
    if not 0 <= n <= MAX_DIMENSION:
        raise ModelFileError(f"{key} must be >= 0 and <= {MAX_DIMENSION}, got {n} in {source}")
    return n


def positive_float(value: Any, key: str, source: str | Path) -> float:
    """A finite number > 0 (an epsilon, a rope base, a scaling factor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFileError(f"{key} must be a number, got {value!r} in {source}")
    if not math.isfinite(value) or value <= 0:
        raise ModelFileError(f"{key} must be a finite number > 0, got {value!r} in {source}")
    return float(value)


def make_arch(source: str | Path, **values: Any) -> ModelArchConfig:
    """ModelArchConfig(**values), its own consistency errors (heads vs kv heads, an odd head
    dimension) naming source too."""
    try:
        return ModelArchConfig(**values)
    except ValueError as err:
        raise ModelFileError(f"{err} in {source}") from None
