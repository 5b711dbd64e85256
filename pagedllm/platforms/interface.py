"""The platform object: the only place that touches device APIs."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch

GiB = 1024 ** 3


def fmt_bytes(n: float) -> str:
    """Human-readable bytes in GiB, MiB or KiB."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 1024 ** 2:.0f} MiB" if abs(n) >= 1024 ** 2 else f"{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class ProbeResult:
    """What one device probe saw, and whether that device is usable."""

    platform: str  # cuda, rocm, xpu, mps, cpu
    usable: bool
    detail: str  # e.g. "torch 2.13.0+cu130 built for CUDA 13.0; no NVIDIA driver found"

    def line(self) -> str:
        """One line for logs and reports."""
        return f"{self.platform}: {'usable' if self.usable else 'not usable'} ({self.detail})"


@dataclass(frozen=True)
class MemoryInfo:
    """Memory this process may use now, and where the number came from."""

    total_bytes: int
    available_bytes: int
    source: str  # e.g. "cgroup v1 limit 3.49 GiB, 3.10 GiB free"


class Platform(ABC):
    """A device kind: name, dtypes, memory, synchronisation, attention backend."""

    name: str = "unknown"
    device_type: str = "cpu"
    attention_backend: str = "torch"  # the plain-PyTorch paged attention

    def device(self) -> torch.device:
        """The torch device the engine runs on."""
        return torch.device(self.device_type)

    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Compute dtypes this device runs (the first one is the fastest)."""

    @abstractmethod
    def default_dtype(self, checkpoint_dtype: Optional[str]) -> torch.dtype:
        """dtype='auto': the checkpoint's dtype where it is fast here, else the best supported."""

    @abstractmethod
    def memory(self) -> MemoryInfo:
        """Memory the engine may plan with."""

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def default_max_num_batched_tokens(self, intermediate_size: int, serving: bool) -> int:
        """The token budget of a step when max_num_batched_tokens is not given (serving: for
        the OpenAI server rather than the offline LLM class)."""
        return 2048

    def describe(self) -> dict[str, Any]:
        """Facts for `pagedllm doctor`."""
        mem = self.memory()
        return {"name": self.name, "device": str(self.device()),
                "attention_backend": self.attention_backend,
                "dtypes": [str(d).removeprefix("torch.") for d in self.supported_dtypes()],
                "memory": {"total_bytes": mem.total_bytes, "available_bytes": mem.available_bytes,
                           "source": mem.source}}
