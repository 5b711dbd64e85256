"""Device and dtype resolution (the full platform layer with probes and reasons is a later issue)."""
from __future__ import annotations

import logging
from typing import Optional, Union

import torch

logger = logging.getLogger("pagedllm")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """'auto' picks CUDA when this torch can use a GPU, else the CPU; an unusable choice is a clear error."""
    name = str(device or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} was asked for but this torch ({torch.__version__}) "
                             "sees no usable CUDA GPU; use device='cpu' or 'auto'")
        return torch.device(name)
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")


def cpu_has_native_bf16() -> bool:
    """True when oneDNN can run bf16 matmuls natively (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: Union[str, torch.dtype, None], checkpoint_dtype: Optional[str],
                  device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's half type where the device computes it fast, else float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype}")
        return dtype
    name = str(dtype or "auto").lower().removeprefix("torch.")
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[name]
    if device.type == "cuda":
        return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16) if checkpoint_dtype != "float32" \
            else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() and checkpoint_dtype != "float32" \
        else torch.float32
