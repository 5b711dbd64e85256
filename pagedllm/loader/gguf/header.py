"""Read and check a GGUF file's header (metadata and tensor table), never its tensor data.

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv      x  key string | value type u32 | value           (string: u64 length, then bytes)
    n_tensors x  name string | n_dims u32 | dims u64 x n_dims | ggml type u32 | offset u64
    padding to general.alignment | tensor data (each offset is relative to its start)

Every count and length is checked against the bytes left in the file before anything is read
or allocated for it, and every tensor's extent against the file's size, so that a truncated,
corrupt or hostile file is refused with one ModelFileError naming the file and what is wrong
(not a MemoryError, an OverflowError, or a numpy reshape error in whatever reads it next).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Optional

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

from pagedllm.loader.errors import ModelFileError
from pagedllm.paths import cache_dir, hub_headers_dir


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is encoded."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: [rows, cols] (GGUF lists dims innermost first)
    offset: int  # absolute byte offset of the payload in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFArrayInfo:
    """A metadata array as its header states it; its values are not read here."""

    etype: int  # GGUF value type id of the elements (8: string, 5: int32, 6: float32, ...)
    length: int


# metadata (arrays: None), tensor table, and each array's type and length
_Parsed = tuple[dict[str, Any], tuple[GGUFTensorInfo, ...], dict[str, GGUFArrayInfo]]

# GGUF value type id -> struct format of a scalar (8: string, 9: array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# The least bytes one entry can take: a metadata pair (empty key, type, a one-byte value) and a
# tensor info (empty name, n_dims, one dim, type, offset).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
# Limits of the GGUF specification (ggml's docs/gguf.md) that llama.cpp enforces too.
_MAX_KEY_BYTES = 65535
_MAX_NAME_BYTES = 64
_MAX_DIMS = 4
_MAX_ELEMENTS = 2**63 - 1  # ggml counts elements in int64


class _HeaderReader:
    """Sequential little-endian reads of a GGUF header, from a buffer filled from the file in
    large reads (a 150k vocabulary is ~300k strings to hop over; one read and seek per string
    took ~1.1 s of every start-up, walking a buffer takes ~0.1 s). Nothing is read or skipped
    past the end of the stream: every length is checked against what is left first."""

    _CHUNK = 1 << 22

    def __init__(self, fh: BinaryIO, source: str) -> None:
        self.fh, self.source = fh, source
        start = fh.tell()
        self.end = fh.seek(0, os.SEEK_END)  # the stream's size
        fh.seek(start)
        self.buf = b""
        self.pos = 0
        self.where = "the GGUF preamble"  # what is being read, for the truncation message

    def fail(self, problem: str) -> ModelFileError:
        """The error for this file."""
        return ModelFileError(f"{self.source}: {problem}")

    def tell(self) -> int:
        """Offset in the file of the next byte to read."""
        return self.fh.tell() - (len(self.buf) - self.pos)

    def left(self) -> int:
        """Bytes between the next byte to read and the end of the stream."""
        return self.end - self.tell()

    def _check_left(self, n: int) -> None:
        if n > self.left():
            raise self.fail(f"the file ends inside {self.where} (it needs {n} bytes at byte "
                            f"{self.tell()}, the file has {self.end}): truncated or corrupt")

    def _need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        self._check_left(n)
        more = self.fh.read(max(n - (len(self.buf) - self.pos), self._CHUNK))
        self.buf = self.buf[self.pos:] + more
        self.pos = 0
        if len(self.buf) < n:  # the file shrank while being read
            raise self.fail(f"the file ends inside {self.where} (it changed while being read)")

    def scalar(self, fmt: str) -> Any:
        """One struct-packed value."""
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        """Step over n bytes; beyond the buffer by seeking (an honest 100 MB array is not read)."""
        buffered = len(self.buf) - self.pos
        if n <= buffered:
            self.pos += n
            return
        self._check_left(n)
        self.fh.seek(n - buffered, os.SEEK_CUR)
        self.buf, self.pos = b"", 0

    def string(self, limit: Optional[int] = None, what: str = "string") -> str:
        """A u64-length-prefixed UTF-8 string of at most limit bytes (else: what is left)."""
        n = self.scalar("<Q")
        if limit is not None and n > limit:
            raise self.fail(f"{self.where}: a {what} of {n} bytes, more than the {limit} allowed")
        self._need(n)
        text = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def count(self, n: int, each: int, what: str) -> None:
        """Refuse a count of items (each at least `each` bytes) the rest of the file cannot hold."""
        if n > self.left() // each:
            raise self.fail(f"{self.where}: {what} {n} cannot fit in the {self.left()} bytes left "
                            f"(each takes at least {each})")

    def value(self, vtype: int) -> Any:
        """A metadata value; an array is skipped, its type and length returned (loading never
        needs its values; the tokenizer's checks need its length)."""
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype != _ARRAY:
            raise self.fail(f"{self.where}: unknown value type {vtype}")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALAR_FORMATS:
            size = struct.calcsize(_SCALAR_FORMATS[etype])
            self.count(count, size, "array length")
            self.skip(count * size)
        elif etype == _STRING:  # token lists and merges: hop over each string
            self.count(count, 8, "array length")
            self._skip_strings(count)
        else:  # llama.cpp reads no arrays of arrays either
            raise self.fail(f"{self.where}: arrays of value type {etype} are not supported")
        return GGUFArrayInfo(etype, count)

    def _skip_strings(self, count: int) -> None:
        unpack = struct.Struct("<Q").unpack_from
        buf, pos = self.buf, self.pos
        for _ in range(count):
            if pos + 8 <= len(buf):
                end = pos + 8 + unpack(buf, pos)[0]
                if end <= len(buf):
                    pos = end
                    continue
            self.pos = pos  # the string runs past the buffer: read it the slow way
            self.skip(self.scalar("<Q"))
            buf, pos = self.buf, self.pos
        self.pos = pos


def _alignment(fields: dict[str, Any], r: _HeaderReader) -> int:
    """general.alignment (default 32), which must be a power of two."""
    align = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise r.fail(f"general.alignment must be a power of two, got {align!r}")
    return align


def _tensor_info(r: _HeaderReader, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, dims as stored, type, offset relative to the data) of the next tensor info."""
    r.where = f"tensor info #{index}"
    name = r.string(_MAX_NAME_BYTES, "tensor name")
    r.where = f"the info of tensor {name!r}"
    n_dims = r.scalar("<I")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
    dims = tuple(r.scalar("<Q") for _ in range(n_dims))
    type_id, offset = r.scalar("<I"), r.scalar("<Q")
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise r.fail(f"tensor {name!r} has unknown ggml type {type_id}") from None
    block = GGML_QUANT_SIZES[qtype][0]
    if min(dims) == 0 or math.prod(dims) > _MAX_ELEMENTS:
        raise r.fail(f"tensor {name!r} has shape {dims}: every dimension must be >= 1 and "
                     f"the product at most {_MAX_ELEMENTS}")
    if dims[0] % block:
        raise r.fail(f"tensor {name!r} has rows of {dims[0]} values, not a multiple of "
                     f"{qtype.name}'s block of {block}")
    return name, dims, qtype, offset


def read_gguf_header(fh: BinaryIO, source: Optional[str | Path] = None
                     ) -> tuple[dict[str, Any], tuple[GGUFTensorInfo, ...]]:
    """(scalar/string metadata, tensor table) of a GGUF v2/v3 stream, reading no tensor data;
    ModelFileError naming source (default: the stream's name) for anything malformed. An
    array's key is there with the value None (gguf_arrays has its type and length).

    The tensors' extents are not checked against the file here (a header-only stub has none of
    its data): check_tensor_extents does that.
    GGUFReader would do this too, but it materialises every token string as a numpy view
    (about 9 s for a 150k vocabulary); walking the header directly takes well under a second.
    """
    fields, tensors, _ = _read_header(fh, source)
    return fields, tensors


def _read_header(fh: BinaryIO, source: Optional[str | Path]) -> _Parsed:
    """read_gguf_header's metadata and tensor table, and the arrays' types and lengths."""
    r = _HeaderReader(fh, str(source or getattr(fh, "name", "GGUF stream")))
    if r.end == 0:
        raise r.fail("the file is empty (0 bytes), not a GGUF file")
    head = fh.read(4)
    fh.seek(-len(head), os.SEEK_CUR)
    if len(head) < 4 or struct.unpack("<I", head)[0] != GGUF_MAGIC:
        raise r.fail(f"not a GGUF file (it starts with {head!r}; a GGUF file starts with b'GGUF')")
    r.skip(4)
    version = r.scalar("<I")
    if version not in (2, 3):
        raise r.fail(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > r.left():
        raise r.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata keys, more than "
                     f"the {r.left()} bytes left in the file could hold: truncated or corrupt")
    fields: dict[str, Any] = {}
    arrays: dict[str, GGUFArrayInfo] = {}
    for i in range(n_kv):
        r.where = f"metadata key #{i}"
        key = r.string(_MAX_KEY_BYTES, "key")
        if key in fields:
            raise r.fail(f"metadata key {key!r} appears twice")
        r.where = f"the value of metadata key {key!r}"
        value = r.value(r.scalar("<I"))
        if isinstance(value, GGUFArrayInfo):
            arrays[key], value = value, None
        fields[key] = value
    raw = [_tensor_info(r, i) for i in range(n_tensors)]
    align = _alignment(fields, r)
    data_start = -(-r.tell() // align) * align
    tensors, seen = [], set()
    for name, dims, qtype, rel in raw:
        if name in seen:
            raise r.fail(f"tensor {name!r} appears twice in the tensor table")
        seen.add(name)
        if rel % align:
            raise r.fail(f"tensor {name!r} has data offset {rel}, not a multiple of the "
                         f"alignment {align}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        tensors.append(GGUFTensorInfo(name=name, qtype=qtype, shape=tuple(reversed(dims)),
                                      offset=data_start + rel,
                                      nbytes=math.prod(dims) // block * type_size))
    return fields, tuple(tensors), arrays


def check_tensor_extents(tensors: tuple[GGUFTensorInfo, ...], file_size: int,
                         source: str | Path) -> None:
    """ModelFileError unless every tensor's bytes lie inside a file of file_size bytes."""
    outside = [t for t in tensors if t.offset + t.nbytes > file_size]
    if outside:
        t = outside[0]
        more = f" (and {len(outside) - 1} more tensors)" if len(outside) > 1 else ""
        raise ModelFileError(
            f"{source}: tensor {t.name!r} needs bytes {t.offset} to {t.offset + t.nbytes} but "
            f"the file has {file_size} bytes{more}: truncated (an interrupted download?) or corrupt")


def is_header_stub(path: str | Path) -> bool:
    """True for the hub's header-only copy of a remote GGUF (its tensor data is not there)."""
    return hub_headers_dir().resolve() in Path(path).resolve().parents


def parse_gguf_file(path: str | Path) -> tuple[dict[str, Any], tuple[GGUFTensorInfo, ...]]:
    """read_gguf_header of a file, with every tensor checked to lie inside it (hub stubs:
    the header only)."""
    fields, tensors, _ = _parse_file(path)
    return fields, tensors


def _parse_file(path: str | Path) -> _Parsed:
    with open(path, "rb") as fh:
        parsed = _read_header(fh, path)
        size = fh.seek(0, os.SEEK_END)
    if not is_header_stub(path):
        check_tensor_extents(parsed[1], size, path)
    return parsed


def gguf_header(path: str | Path) -> tuple[dict[str, Any], tuple[GGUFTensorInfo, ...]]:
    """parse_gguf_file, once per process (keyed by path, size and mtime); the metadata dict is
    shared: read it, do not change it."""
    fields, tensors, _ = _header_of(path)
    return fields, tensors


def gguf_arrays(path: str | Path) -> dict[str, GGUFArrayInfo]:
    """The type and length of each metadata array of a GGUF file, from the header gguf_header
    parsed (no array is read); shared: read it, do not change it."""
    return _header_of(path)[2]


def _header_of(path: str | Path) -> _Parsed:
    st = os.stat(path)
    return _cached_header(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _cached_header(path: str, size: int, mtime_ns: int) -> _Parsed:
    kept = _kept_header_path(path, size, mtime_ns)
    header = _read_kept_header(kept)
    if header is None:
        header = _parse_file(path)
        _keep_header(kept, header)
    return header


# --- the parsed header kept on disk ----------------------------------------------------------
# Walking a 152k-token vocabulary's strings takes ~0.2 s of every start; the parsed header
# (arrays None, their types and lengths beside; the rest JSON's types) is kept in
# cache_dir()/gguf-headers, keyed by the file's path, size and mtime, and only a successful
# parse is kept.
_HEADER_FORMAT = 2  # bump when GGUFTensorInfo or the parse changes
_KEPT_HEADERS = 64  # the oldest beyond this are removed


def _kept_header_path(path: str, size: int, mtime_ns: int) -> Path:
    key = f"{_HEADER_FORMAT}\0{path}\0{size}\0{mtime_ns}"
    return cache_dir() / "gguf-headers" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_kept_header(kept: Path) -> Optional[_Parsed]:
    """The header kept at `kept`, or None if there is none or it cannot be read."""
    try:
        data = json.loads(kept.read_text(encoding="utf-8"))
        tensors = tuple(GGUFTensorInfo(name=n, qtype=GGMLQuantizationType(q), shape=tuple(s),
                                       offset=o, nbytes=b) for n, q, s, o, b in data["tensors"])
        arrays = {k: GGUFArrayInfo(int(t), int(n)) for k, (t, n) in data["arrays"].items()}
        return data["fields"], tensors, arrays
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep_header(kept: Path, header: _Parsed) -> None:
    """Write the header atomically; a cache that cannot be written only costs the next start."""
    fields, tensors, arrays = header
    text = json.dumps({"fields": fields, "tensors": [
        (t.name, int(t.qtype), list(t.shape), t.offset, t.nbytes) for t in tensors],
        "arrays": {k: (a.etype, a.length) for k, a in arrays.items()}})
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, kept)
        old = sorted(kept.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for stale in old[:-_KEPT_HEADERS]:
            stale.unlink(missing_ok=True)
    except OSError:
        pass
