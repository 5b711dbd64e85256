"""Device resolution with reasons: CUDA, ROCm, Intel XPU, Apple MPS, then the CPU; never 'no platform'."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.gpu import GPU_DEVICE_TYPES, PROBES, TorchGpuPlatform
from pagedllm.platforms.interface import MemoryInfo, Platform, ProbeResult

logger = logging.getLogger("pagedllm")

DEVICE_ENV_VARS = ("PAGEDLLM_DEVICE", "VLLM_TARGET_DEVICE")
_DEVICES = ("auto", "cpu", "cuda", "rocm", "xpu", "mps")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

__all__ = ["Platform", "ProbeResult", "MemoryInfo", "PlatformChoice", "resolve_platform",
           "resolve_dtype", "cpu_has_native_bf16", "DEVICE_ENV_VARS"]


@dataclass(frozen=True)
class PlatformChoice:
    """The platform picked, every probe's finding, and why this one."""

    platform: Platform
    probes: tuple[ProbeResult, ...]
    requested: str  # auto, cpu, cuda, ...
    source: str  # "default", "device argument", "PAGEDLLM_DEVICE", "VLLM_TARGET_DEVICE"

    def summary(self) -> str:
        """The one start-up log line."""
        others = "; ".join(p.line() for p in self.probes if p.platform != self.platform.name)
        return (f"device {self.platform.name} ({self.source}: {self.requested})"
                + (f"; {others}" if others else ""))


def requested_device(device: Union[str, torch.device, None]) -> tuple[str, str]:
    """(device name, where it came from): an explicit argument, else the environment, else auto."""
    name = str(device).strip().lower() if device is not None else "auto"
    if name != "auto":
        return name, "device argument"
    for var in DEVICE_ENV_VARS:
        value = os.environ.get(var, "").strip().lower()
        if value and value != "auto":
            return value, var
    return "auto", "default"


def resolve_platform(device: Union[str, torch.device, None] = "auto") -> PlatformChoice:
    """Pick the platform: the first usable accelerator for auto, else exactly what was asked."""
    name, source = requested_device(device)
    kind, _, index = name.partition(":")
    kind = {"gpu": "cuda", "hip": "rocm"}.get(kind, kind)
    if kind not in _DEVICES:
        raise ValueError(f"device must be one of {', '.join(_DEVICES)} (or cuda:N), got {name!r}"
                         f" from the {source}")
    probes = tuple(probe() for _, probe in PROBES) + (ProbeResult("cpu", True, "always usable"),)
    by_name = {p.platform: p for p in probes}
    if kind == "auto":
        kind = next(p.platform for p in probes if p.usable)
    elif not by_name[kind].usable:
        found = [p.platform for p in probes if p.usable]
        raise ValueError(f"device={name!r} ({source}) is not usable here: {by_name[kind].detail}. "
                         f"Usable here: {', '.join(found)}; pass device='cpu' or 'auto'")
    choice = PlatformChoice(_make_platform(kind, index), probes, name, source)
    logger.info("%s", choice.summary())
    return choice


def _make_platform(kind: str, index: str) -> Platform:
    if kind == "cpu":
        return cpu_platform()
    device_type = GPU_DEVICE_TYPES[kind]
    platform = TorchGpuPlatform(kind, f"{device_type}:{index}" if index else device_type)
    return platform


@lru_cache(maxsize=1)
def cpu_platform() -> CpuPlatform:
    """The CPU platform of this process (reads /proc and cgroups once)."""
    return CpuPlatform()


def cpu_has_native_bf16() -> bool:
    """True when this CPU runs bf16 matmuls natively (AVX512-BF16 / AMX)."""
    return cpu_platform().info.native_bf16


def resolve_dtype(dtype: Union[str, torch.dtype, None], checkpoint_dtype: Optional[str],
                  platform: Platform) -> torch.dtype:
    """An explicit dtype, or the platform's choice for 'auto'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype}")
        return dtype
    name = str(dtype or "auto").lower().removeprefix("torch.")
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[name]
    return platform.default_dtype(checkpoint_dtype)
