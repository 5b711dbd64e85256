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


# The plain-PyTorch paged attention: every platform's fallback and the correctness oracle.
TORCH_ATTN_BACKEND = "pagedllm.attention.backends.torch_ref.TorchAttentionBackend"


class Platform(ABC):
    """A device kind: name, dtypes, memory, synchronisation, and which code runs on it.

    The choice of implementation is made here, once, when the model is built: each layer with
    several implementations asks op_impl(dtype) for its forward_<impl>, and the Attention layer
    and the model runner ask get_attn_backend(dtype) for their backend.
    """

    name: str = "unknown"
    device_type: str = "cpu"

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

    def init_device(self) -> None:
        """Per-process set-up before the model is built (threads, allocator)."""

    def block_types(self) -> frozenset:
        """GGML block formats whose matrices this platform computes on directly (kept, not
        dequantized at load); empty where it has no such kernels."""
        return frozenset()

    def load_kernels(self) -> bool:
        """Build (if needed) and load this platform's compiled ops; True when they are usable.
        Called once, before the model is built; a failure is logged, not raised."""
        return False

    @property
    def kernels_ready(self) -> bool:
        """The compiled ops are loaded (never builds)."""
        return False

    @property
    def kernels_error(self) -> Optional[str]:
        """Why load_kernels() found the compiled ops unusable, in one line; None otherwise."""
        return None

    def op_impl(self, dtype: torch.dtype) -> str:
        """Which forward_<impl> layers with several implementations run: "native" (PyTorch)
        unless the platform has its own ops for this dtype."""
        return "native"

    def get_attn_backend(self, dtype: torch.dtype) -> str:
        """Qualified class name of the attention backend for a KV cache of this dtype (a name,
        so that platforms import nothing from the layers above them)."""
        return TORCH_ATTN_BACKEND

    def attention_backend(self, dtype: torch.dtype) -> str:
        """Short name of the attention backend get_attn_backend picks ("torch", "cpu", ...)."""
        return self.get_attn_backend(dtype).rsplit(".", 2)[-2].removesuffix("_ref")

    def default_max_num_batched_tokens(self, intermediate_size: int, serving: bool) -> int:
        """The token budget of a step when max_num_batched_tokens is not given (serving: for
        the OpenAI server rather than the offline LLM class)."""
        return 2048

    def describe(self) -> dict[str, Any]:
        """Facts for `pagedllm doctor`."""
        mem = self.memory()
        return {"name": self.name, "device": str(self.device()),
                "attention_backend": self.attention_backend(torch.float32),
                "kernels_loaded": self.kernels_ready,
                "dtypes": [str(d).removeprefix("torch.") for d in self.supported_dtypes()],
                "memory": {"total_bytes": mem.total_bytes, "available_bytes": mem.available_bytes,
                           "source": mem.source}}
