"""The KV cache's allocation: zeros, committed as tokens are written, in 4 KiB pages."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedllm.worker.kv_cache import allocate_kv_cache

SMAPS = Path("/proc/self/smaps")


def _mapping(address: int) -> dict[str, str]:
    """The smaps fields of the mapping that holds address."""
    lines = SMAPS.read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" not in span or ":" in span:
            continue
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            fields = {}
            for field in lines[i + 1:]:
                name, _, value = field.partition(":")
                if "-" in name:  # the next mapping's header
                    break
                fields[name] = value.strip()
            return fields
    raise AssertionError(f"no mapping holds {address:#x}")


def _kib(field: str) -> int:
    """'1234 kB' -> 1234"""
    number, unit = field.split()
    assert unit == "kB", field
    return int(number)


def _rss_kib() -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS"))


def test_cache_reads_as_zeros_in_its_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        kv = allocate_kv_cache(2, 3, 16, 2, 64, dtype, torch.device("cpu"))
        assert kv.shape == (2, 2, 3, 16, 2, 64) and kv.dtype == dtype
        assert kv.is_contiguous() and not kv.any()
        kv[1, 0, 2] = 1.5
        assert kv.sum().item() == 1.5 * 16 * 2 * 64


@pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")
def test_pages_are_committed_by_writes_and_never_huge():
    """A 96 MiB cache: nothing resident until written; writing 1 MiB of each of its 48 regions
    (a 24-layer model's keys and values) commits ~48 MiB, not 48 huge pages of 2 MiB, whose
    first write zeroes 2 MiB inside a step (numpy's zeros asks for them)."""
    kv = allocate_kv_cache(24, 3072, 16, 2, 64, torch.float32, torch.device("cpu"))
    mapping = _mapping(kv.data_ptr())
    assert "nh" in mapping["VmFlags"].split(), mapping["VmFlags"]  # MADV_NOHUGEPAGE
    before = _rss_kib()
    assert _kib(mapping["Rss"]) < 1024, mapping["Rss"]
    regions = kv.view(48, -1)
    regions[:, :262_144] = 1.0  # 1 MiB of float32 in each
    # the mapping's own Rss (smaps walks its page tables): VmRSS is the kernel's per-CPU
    # counters, which may lag by a few hundred pages (it read 48,144 KiB once in CI)
    grown = _kib(_mapping(kv.data_ptr())["Rss"])
    assert 48 * 1024 <= grown < 48 * 1024 + 1024, grown
    assert _mapping(kv.data_ptr()).get("AnonHugePages", "0 kB") == "0 kB"
    del kv, regions
    gc.collect()
    assert _rss_kib() - before < 8 * 1024  # unmapped with the tensor
