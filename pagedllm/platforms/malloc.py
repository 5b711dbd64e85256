"""glibc malloc settings for a CPU engine: keep freed activation buffers instead of unmapping them.

glibc serves a block above its mmap threshold (128 KiB at first, raised up to 32 MiB as such
blocks are freed) with a fresh mmap, and gives it back on free; heap memory above the trim
threshold at the top of the heap is given back too. Each step of a prefill allocates tens of MB
of activations, so every step page-faulted them in again and the kernel zeroed them: on the
default model, 32 prompts of 100 tokens spent ~4 s of a 26 s run in the kernel. With the
threshold pinned at its 32 MiB maximum and a trim threshold of 256 MiB, the heap keeps and
reuses them (0.7 s). Blocks of 32 MiB or more are mmapped whatever the setting, which is why
the CPU's default token budget keeps a step's largest activation under that (cpu.py).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Optional

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling on 64-bit (4 * 1024 * 1024 * sizeof(long))
TRIM_THRESHOLD = 256 * 1024 * 1024


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
        libc.gnu_get_libc_version  # only glibc has it (not musl, not macOS)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Pin glibc's mmap threshold at its maximum and raise its trim threshold; False where
    this is not glibc (nothing is changed there)."""
    libc = _glibc()
    if libc is None:
        return False
    ok = (libc.mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1
          and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not ok:
        logger.debug("mallopt refused the mmap/trim thresholds; keeping glibc's defaults")
    return ok


def trim_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim); False where this is
    not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


__all__ = ["keep_freed_memory", "trim_freed_memory", "MAX_MMAP_THRESHOLD"]
