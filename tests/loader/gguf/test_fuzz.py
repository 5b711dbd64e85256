"""Fuzzing the GGUF header reader with mutated copies of SmolLM2's real header.

Each case either parses into a consistent header (every tensor inside the file, every
dimension >= 1) and then into a ModelArchConfig or a ModelFileError, or is refused with a
ModelFileError; never another exception, never a large allocation.
"""
from __future__ import annotations

import os
import random
import struct
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm.loader.gguf import header as header_module
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.arch import arch_from_header
from pagedllm.loader.gguf.header import gguf_header, parse_gguf_file, read_gguf_header

CASES = 400
SEED = 13
# Values a corrupt or hostile count, length, type or offset field tends to hold.
NASTY_U64 = (0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1)
NASTY_U32 = (0, 1, 4, 8, 9, 13, 255, 2**16, 2**31, 2**32 - 1)
_WRITE_TYPES = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
                float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
_ARRAYS = {"tokenizer.ggml.tokens": [f"tok{i}" for i in range(64)],
           "tokenizer.ggml.token_type": [1] * 64,
           "tokenizer.ggml.merges": [f"t {i}" for i in range(64)], "general.languages": ["en"]}


@dataclass(frozen=True)
class SlimGGUF:
    """A GGUF file with SmolLM2's metadata and tensor table, and where its parts start."""

    path: Path
    header: bytes  # everything before the tensor data
    table_start: int  # offset of the first tensor info
    size: int  # bytes the tensor table needs (the file is sparse: its data are zeros)


@pytest.fixture(scope="module")
def slim(smollm_gguf, tmp_path_factory) -> SlimGGUF:
    """SmolLM2's header rewritten by gguf's writer with its vocabulary arrays cut to 64 entries:
    the same keys, types and tensor table in ~20 kB, so a parse takes ~1 ms instead of ~60."""
    fields, tensors = gguf_header(smollm_gguf)
    path = tmp_path_factory.mktemp("fuzz") / "slim.gguf"
    writer = gguf.GGUFWriter(str(path), fields["general.architecture"])
    for key, value in fields.items():
        if key == "general.architecture":
            continue  # the writer's own first key
        if value is None:
            writer.add_array(key, _ARRAYS[key])
        else:
            writer.add_key_value(key, value, _WRITE_TYPES[type(value)])
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "rb") as fh:
        written = read_gguf_header(fh)[1]
    size = max(t.offset + t.nbytes for t in written)
    header = path.read_bytes()
    first = written[0].name.encode()
    os.truncate(path, size)
    assert [(t.name, t.shape, t.qtype) for t in written] == [(t.name, t.shape, t.qtype) for t in tensors]
    return SlimGGUF(path, header, header.index(struct.pack("<Q", len(first)) + first), size)


def _peak_rss() -> int:
    """This process's peak resident memory in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _mutate(slim: SlimGGUF, rng: random.Random) -> tuple[str, bytes, int]:
    """(description, header bytes, file size) of one mutated case: half of them hit the
    metadata, half the tensor table."""
    data, size = bytearray(slim.header), slim.size
    lo, hi = (0, slim.table_start) if rng.random() < 0.5 else (slim.table_start, len(data))
    at, kind = rng.randrange(lo, hi), rng.choice(("bytes", "u64", "u32", "cut"))
    if kind == "bytes":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(lo, hi)] = rng.randrange(256)
    elif kind in ("u64", "u32"):
        packed = (struct.pack("<Q", rng.choice(NASTY_U64)) if kind == "u64"
                  else struct.pack("<I", rng.choice(NASTY_U32)))
        data[at:at + len(packed)] = packed[:len(data) - at]
    else:  # cut inside the header, or inside the data
        size = rng.randrange(len(data)) if rng.random() < 0.7 else rng.randrange(len(data), size)
    return f"{kind} at {at}", bytes(data), size


def test_mutated_headers_parse_consistently_or_raise_model_file_error(slim, monkeypatch):
    # 4 kB reads (not 4 MiB): each case refills the buffer inside strings, arrays and tables
    monkeypatch.setattr(header_module._HeaderReader, "_CHUNK", 4096)
    rng = random.Random(SEED)
    outcomes = {"refused": 0, "parsed": 0, "refused_arch": 0}
    started, peak_rss = time.monotonic(), _peak_rss()
    for case in range(CASES):
        what, data, size = _mutate(slim, rng)
        with open(slim.path, "r+b") as fh:
            fh.write(data)
            fh.truncate(size)
        try:
            fields, tensors = parse_gguf_file(slim.path)
        except ModelFileError:
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case} ({what}): {type(err).__name__}: {err}")
        for t in tensors:
            assert min(t.shape) >= 1 and t.offset + t.nbytes <= size, (case, what, t)
        try:
            arch_from_header(fields, tensors, slim.path)
            outcomes["parsed"] += 1
        except ModelFileError:
            outcomes["refused_arch"] += 1
        except Exception as err:  # noqa: BLE001
            pytest.fail(f"case {case} ({what}), metadata: {type(err).__name__}: {err}")
    elapsed, grown = time.monotonic() - started, _peak_rss() - peak_rss
    print(f"{CASES} cases in {elapsed:.1f} s, peak RSS grew {grown / 2**20:.0f} MiB: {outcomes}")
    assert grown < 256 * 2**20  # nothing sized by a hostile field was allocated and filled
    assert outcomes["refused"] >= CASES // 4 and outcomes["parsed"] >= CASES // 10, outcomes
