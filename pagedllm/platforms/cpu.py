"""The CPU platform: ISA features, usable cores, cgroup-aware memory."""
from __future__ import annotations

import os
import platform as _platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import psutil
import torch

from pagedllm import kernels
from pagedllm.platforms import cgroup
from pagedllm.platforms.interface import MemoryInfo, Platform, fmt_bytes
from pagedllm.platforms.malloc import MAX_MMAP_THRESHOLD, keep_freed_memory

# C++ paged decode attention over a float32 cache, PyTorch SDPA for prompt chunks
CPU_ATTN_BACKEND = "pagedllm.attention.backends.cpu.CpuAttentionBackend"

# ISA features that change which kernels and dtypes are fast
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True)
class CpuInfo:
    """Model name, ISA features and how many threads this process should use."""

    model_name: str
    features: tuple[str, ...]
    threads: int
    threads_source: str  # e.g. "affinity 2 CPUs, no cgroup quota"

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run natively (AVX512-BF16 or AMX)."""
        return "avx512_bf16" in self.features or "amx_bf16" in self.features


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(model name, ISA features of interest) from /proc/cpuinfo text."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model or _platform.processor() or "unknown", tuple(f for f in ISA_FLAGS if f in flags)


def usable_threads(affinity: int, quota: Optional[int]) -> tuple[int, str]:
    """Threads to run: the CPUs this process may run on, capped by a cgroup CPU quota."""
    if quota is not None and quota < affinity:
        return max(1, quota), f"cgroup CPU quota {quota} of {affinity} CPUs in affinity"
    return affinity, f"affinity {affinity} CPUs" + (
        f", cgroup quota {quota}" if quota is not None else ", no cgroup CPU quota")


def read_cpu_info() -> CpuInfo:
    """CpuInfo of this machine and process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model, features = parse_cpuinfo(text)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    threads, source = usable_threads(affinity, cgroup.cpu_quota())
    return CpuInfo(model, features, threads, source)


def memory_info(vm_available: int, vm_total: int,
                cg: Optional[cgroup.CgroupMemory]) -> MemoryInfo:
    """The smaller of what the OS reports available and what the cgroup still allows."""
    os_line = f"system {fmt_bytes(vm_available)} available of {fmt_bytes(vm_total)}"
    if cg is not None and cg.free_bytes < vm_available:
        return MemoryInfo(min(cg.limit_bytes, vm_total), cg.free_bytes,
                          f"cgroup v{cg.version} limit {fmt_bytes(cg.limit_bytes)}, "
                          f"{fmt_bytes(cg.free_bytes)} free; {os_line}")
    return MemoryInfo(vm_total, vm_available, os_line)


class CpuPlatform(Platform):
    """Runs on the host CPU with the plain-PyTorch attention backend."""

    name = "cpu"
    device_type = "cpu"

    def __init__(self, info: Optional[CpuInfo] = None) -> None:
        self.info = info or read_cpu_info()

    def init_device(self) -> None:
        self.apply_threads()

    def block_types(self) -> frozenset:
        from pagedllm.kernels.types import KERNEL_TYPES  # imports gguf: only when asked

        return KERNEL_TYPES

    def load_kernels(self) -> bool:
        return kernels.kernels_available()

    @property
    def kernels_ready(self) -> bool:
        return kernels.kernels_loaded()

    @property
    def kernels_error(self) -> Optional[str]:
        error = kernels.build_error()
        return None if error is None else str(error)

    def op_impl(self, dtype: torch.dtype) -> str:
        # the C++ ops (kernels/csrc/cpu_ops.cpp) take float32 tensors
        return "cpu" if dtype == torch.float32 and self.kernels_ready else "native"

    def get_attn_backend(self, dtype: torch.dtype) -> str:
        if self.op_impl(dtype) == "cpu":  # the C++ attention runs where the C++ ops do
            return CPU_ATTN_BACKEND
        return super().get_attn_backend(dtype)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if self.info.native_bf16:
            return (torch.bfloat16, torch.float32, torch.float16)
        return (torch.float32, torch.bfloat16, torch.float16)

    def default_dtype(self, checkpoint_dtype: Optional[str]) -> torch.dtype:
        # without native bf16 a bf16 matmul is emulated and batched ones run ~5x slower than fp32
        if self.info.native_bf16 and checkpoint_dtype != "float32":
            return torch.bfloat16
        return torch.float32

    def memory(self) -> MemoryInfo:
        vm = psutil.virtual_memory()
        return memory_info(vm.available, vm.total, cgroup.memory_limit())

    def apply_threads(self) -> None:
        """Set torch's intra-op threads to the cores this process may use, and let malloc keep
        freed activation buffers for the next step (malloc.py)."""
        torch.set_num_threads(self.info.threads)
        keep_freed_memory()

    def default_max_num_batched_tokens(self, intermediate_size: int, serving: bool) -> int:
        """The most tokens a step computes: at most 2048, and few enough that the largest
        activation (float32 [tokens, intermediate_size]) stays under glibc's 32 MiB mmap
        ceiling, in multiples of 256 (at least 256). A server takes 256: a step then holds ~1 s
        of prefill here, so the prompts of requests that arrive together are spread over steps
        and the first of them answer sooner (TTFT p50 at concurrency 16 on the default model:
        3.2-3.5 s against 7.0-7.1 s with 1536, for ~7 % less output throughput)."""
        if serving:
            return 256
        fits = MAX_MMAP_THRESHOLD // (4 * intermediate_size)
        return max(256, min(2048, fits // 256 * 256))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["cpu"] = {"model": self.info.model_name, "features": list(self.info.features),
                    "threads": self.info.threads, "threads_source": self.info.threads_source,
                    "native_bf16": self.info.native_bf16}
        return d
