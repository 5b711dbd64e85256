"""Read and check a .safetensors file's JSON header (its first 8 + N bytes), never its data.

    N u64 little-endian | N bytes of JSON: {name: {"dtype", "shape", "data_offsets"}, "__metadata__"?}

The data offsets are not checked against the file's size here: the hub's header-only stubs
hold no data by design, and safetensors' own reader checks them when the weights are loaded.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from pagedllm.loader.errors import ModelFileError

# The safetensors library refuses larger headers too.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _json_header(path: Path) -> dict[str, Any]:
    """The parsed JSON object of the header, its length checked against the file first."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(0)
        if size < 8:
            raise ModelFileError(f"{path}: {size} bytes is too short for a safetensors file "
                                 "(it starts with an 8-byte header length)")
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ModelFileError(f"{path}: the header length is {n} bytes but the file has "
                                 f"{size - 8} after it (at most {MAX_HEADER_BYTES} allowed): "
                                 "truncated or not a safetensors file")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ModelFileError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: the safetensors header must be a JSON object")
    return header


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(path: Path, name: str, entry: Any) -> tuple[int, ...]:
    """The shape of one tensor entry, after checking its fields."""
    shape = entry.get("shape") if isinstance(entry, dict) else None
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
          and isinstance(shape, list) and all(_is_count(d) for d in shape)
          and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
          and offsets[0] <= offsets[1])
    if not ok:
        raise ModelFileError(f"{path}: tensor {name!r} must have a dtype string, a shape of "
                             f"integers >= 0 and data_offsets [begin, end], got {entry!r:.200}")
    return tuple(shape)


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a .safetensors file, from its checked header."""
    path = Path(path)
    header = _json_header(path)
    return {name: _shape(path, name, entry) for name, entry in header.items()
            if name != "__metadata__"}


def safetensors_num_params(path: str | Path) -> int:
    """Elements in one .safetensors file (rotary inv_freq buffers are not parameters)."""
    return sum(math.prod(shape) for name, shape in safetensors_shapes(path).items()
               if not name.endswith("rotary_emb.inv_freq"))
