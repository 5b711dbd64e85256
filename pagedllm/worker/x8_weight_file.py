"""File-backed block weights: a GGUF's kept blocks, regrouped for the CPU kernels once, kept in a
cache file and mapped from it, so that they live in the page cache instead of anonymous memory.

A model whose blocks do not fit beside the runtime and KV cache in anonymous memory (a 7B Q2_K
on a 3.5 GiB VM) still runs: the kernel reads mapped pages, and the kernel's page cache holds
what fits and re-reads the rest from disk. The first load writes the file one matrix at a time
(load, regroup, append, free), so it never holds more than one matrix in anonymous memory.

    cache_dir()/x8-weights/<hash of the GGUF's path>/<"all", or a pipeline stage's part>/
        index.json    {"key": ..., "tensors": [[offset, rows, bytes], ...]} in slot order
        weights.bin   the regrouped tensors, each at a 4 KiB-aligned offset

The key covers the GGUF (path, size, mtime), the x8 layout (the C++ layout headers' text) and
the slots (type, shape); a file that no longer matches is rewritten.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from pagedllm.layers.ggml_linear import X8_ROWS, X8Slot
from pagedllm.paths import cache_dir

logger = logging.getLogger("pagedllm")

_ALIGN = 4096
_LAYOUT_SOURCES = ("ggml_x8_layout.h", "ggml_x8_layout_low.h")


def _layout_hash() -> str:
    """Hash of the x8 record layout's definition (the kernels' C++ headers)."""
    csrc = Path(__file__).resolve().parents[1] / "kernels" / "csrc"
    h = hashlib.sha256()
    for name in _LAYOUT_SOURCES:
        h.update((csrc / name).read_bytes())
    return h.hexdigest()[:16]


def cache_key(gguf: Path, slots: Sequence[X8Slot]) -> str:
    """What the cached file depends on: the GGUF file, the layout and the slots' shapes."""
    st = gguf.stat()
    shapes = [(int(s.qtype), *s.shape, s.k) for s in slots]
    text = json.dumps([str(gguf.resolve()), st.st_size, st.st_mtime_ns, _layout_hash(), shapes])
    return hashlib.sha256(text.encode()).hexdigest()


def cache_path(gguf: Path, part: str = "all") -> Path:
    """The cache directory of one GGUF's blocks: "all" of them, or a pipeline stage's part
    (one per file and part: a changed file replaces its copy)."""
    name = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:24]
    return cache_dir() / "x8-weights" / name / part


def pack_chunks(slot: X8Slot, chunk_bytes: int = 8 << 20) -> Iterator[torch.Tensor]:
    """The slot's weight regrouped, [groups, bytes] pieces of about chunk_bytes in row order."""
    src = slot.source
    rows = max(X8_ROWS, chunk_bytes // max(1, src.shape[1]) // X8_ROWS * X8_ROWS)
    for r0 in range(0, src.shape[0], rows):
        yield torch.ops.pagedllm.ggml_pack_x8(src[r0:r0 + rows], int(slot.qtype), slot.k)


def _read_index(root: Path, key: str) -> Optional[list[list[int]]]:
    """The tensors' [offset, rows, bytes] if the cache at root is complete and matches key."""
    try:
        index = json.loads((root / "index.json").read_text())
        size = (root / "weights.bin").stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("key") != key:
        return None
    tensors = index.get("tensors")
    if not isinstance(tensors, list) or any(o + r * b > size for o, r, b in tensors):
        return None
    return tensors


def _write(root: Path, key: str, slots: Sequence[X8Slot],
           load: Callable[[X8Slot], None], free: Callable[[X8Slot], None]) -> list[list[int]]:
    """Write every slot regrouped (load fills a slot's source, free releases it) into root.
    A matrix is regrouped a few MiB at a time: a whole one would be a second copy of it, and
    memory freed to malloc here stays with the process (platforms/malloc.py)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "index.json").unlink(missing_ok=True)  # incomplete until the index is back
    tmp = root / f"weights.bin.{os.getpid()}.tmp"
    tensors: list[list[int]] = []
    try:
        with open(tmp, "wb") as fh:
            for slot in slots:
                load(slot)
                offset, groups, nbytes = fh.tell(), 0, 0
                for packed in pack_chunks(slot):
                    fh.write(memoryview(packed.numpy()))
                    groups, nbytes = groups + packed.shape[0], packed.shape[1]
                free(slot)
                tensors.append([offset, groups, nbytes])
                fh.write(b"\0" * (-fh.tell() % _ALIGN))
        os.replace(tmp, root / "weights.bin")
    finally:
        tmp.unlink(missing_ok=True)
    (root / "index.json").write_text(json.dumps({"key": key, "tensors": tensors}))
    return tensors


def map_slots(gguf: Path, part: str, slots: Sequence[X8Slot], load: Callable[[X8Slot], None],
              free: Callable[[X8Slot], None]) -> int:
    """Put every slot's regrouped weight in place as a view of the mapped cache file, writing the
    file first when it is missing or stale. Returns the mapped bytes."""
    root, key = cache_path(gguf, part), cache_key(gguf, slots)
    tensors = _read_index(root, key)
    if tensors is None:
        logger.info("writing the regrouped blocks of %s to %s (once per file)", gguf.name, root)
        tensors = _write(root, key, slots, load, free)
    else:
        for slot in slots:
            free(slot)
    path = root / "weights.bin"
    size = path.stat().st_size
    # MAP_PRIVATE: pages come from the page cache and are never written
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    for slot, (offset, rows, nbytes) in zip(slots, tensors):
        slot.put(mapped[offset:offset + rows * nbytes].view(rows, nbytes))
    return sum(rows * nbytes for _, rows, nbytes in tensors)
