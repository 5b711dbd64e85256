"""Accelerator platforms (CUDA, ROCm, Intel XPU, Apple MPS) and the probes that find them."""
from __future__ import annotations

import ctypes.util
import os
from typing import Any, Optional

import torch

from pagedllm.platforms.interface import MemoryInfo, Platform, ProbeResult, fmt_bytes


def nvidia_driver_present() -> bool:
    """An NVIDIA kernel driver or its user-space library is installed."""
    return os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None


def _build() -> str:
    return f"torch {torch.__version__}"


def probe_cuda() -> ProbeResult:
    """Is there an NVIDIA GPU this torch can use?"""
    if torch.version.cuda is None:
        return ProbeResult("cuda", False, f"{_build()} is not a CUDA build")
    built = f"{_build()} built for CUDA {torch.version.cuda}"
    if not nvidia_driver_present():
        return ProbeResult("cuda", False, f"{built}; no NVIDIA driver found")
    try:
        usable = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except RuntimeError as err:  # a driver too old for this build, a broken install
        return ProbeResult("cuda", False, f"{built}; {err}")
    if not usable:
        return ProbeResult("cuda", False, f"{built}; driver present but no usable GPU")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return ProbeResult("cuda", True, f"{built}; {names}")


def probe_rocm() -> ProbeResult:
    """Is there an AMD GPU this (ROCm) torch can use?"""
    hip = getattr(torch.version, "hip", None)
    if hip is None:
        return ProbeResult("rocm", False, f"{_build()} is not a ROCm build")
    ok = torch.cuda.is_available()
    return ProbeResult("rocm", ok, f"{_build()} built for HIP {hip}; "
                       + ("GPU found" if ok else "no usable AMD GPU"))


def probe_xpu() -> ProbeResult:
    """Is there an Intel GPU this torch can use?"""
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return ProbeResult("xpu", False, f"{_build()} has no XPU support")
    ok = bool(xpu.is_available())
    return ProbeResult("xpu", ok, "Intel GPU found" if ok else "no Intel GPU")


def probe_mps() -> ProbeResult:
    """Is this an Apple-silicon Mac with Metal?"""
    mps = getattr(torch.backends, "mps", None)
    ok = bool(mps is not None and mps.is_available())
    return ProbeResult("mps", ok, "Apple GPU found" if ok else "not an Apple-silicon Mac")


class TorchGpuPlatform(Platform):
    """A GPU reached through a torch device module (torch.cuda, torch.xpu, torch.mps)."""

    def __init__(self, name: str, device_type: str, utilization: float = 0.9) -> None:
        self.name, self.device_type, self.utilization = name, device_type, utilization

    def _module(self) -> Any:
        return getattr(torch, "cuda" if self.device_type == "cuda" else self.device_type)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def default_dtype(self, checkpoint_dtype: Optional[str]) -> torch.dtype:
        if checkpoint_dtype == "float16":
            return torch.float16
        return torch.float32 if checkpoint_dtype == "float32" else torch.bfloat16

    def memory(self) -> MemoryInfo:
        module = self._module()
        if hasattr(module, "mem_get_info"):
            free, total = module.mem_get_info()
        else:  # MPS shares system memory
            import psutil

            vm = psutil.virtual_memory()
            free, total = vm.available, vm.total
        usable = int(free * self.utilization)
        return MemoryInfo(total, usable, f"{self.name} {fmt_bytes(free)} free of "
                          f"{fmt_bytes(total)}, x {self.utilization} utilization")

    def synchronize(self) -> None:
        self._module().synchronize()


def list_gpus() -> list[dict[str, Any]]:
    """Each visible CUDA/ROCm GPU with its free and total memory (empty without one)."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "free_bytes": free,
                     "total_bytes": total})
    return gpus


PROBES = (("cuda", probe_cuda), ("rocm", probe_rocm), ("xpu", probe_xpu), ("mps", probe_mps))
GPU_DEVICE_TYPES = {"cuda": "cuda", "rocm": "cuda", "xpu": "xpu", "mps": "mps"}
