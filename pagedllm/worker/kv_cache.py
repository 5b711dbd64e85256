"""The paged KV cache tensor: its size per block and its allocation."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.memory.footprint import kv_bytes_per_token


def kv_block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                   num_layers: Optional[int] = None) -> int:
    """Bytes one KV block takes over all layers, or over num_layers of them (a pipeline
    stage's), keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    whole = block_size * kv_bytes_per_token(arch, itemsize)  # the memory planner's figure
    return whole if num_layers is None else whole // arch.num_hidden_layers * num_layers


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole KV cache in one allocation: [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # calloc'd memory reads as zeros but the OS commits a page only when it is first written,
    # so resident memory grows with the tokens actually cached, not with the planned size
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(math.prod(shape) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)
