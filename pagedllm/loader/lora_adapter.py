"""A LoRA adapter by its path: a PEFT directory (lora/peft.py) or llama.cpp's GGUF adapter file
(gguf/lora.py), read into the same checked LoRAAdapter."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.loader.gguf.lora import check_gguf_adapter, load_gguf_adapter
from pagedllm.lora import peft
from pagedllm.lora.peft import AdapterConfig, LoRAAdapter
from pagedllm.lora.request import LoRARequest


def is_gguf_adapter(request: LoRARequest) -> bool:
    """Whether the adapter's path names a .gguf file rather than a PEFT directory."""
    return Path(request.lora_path).suffix.lower() == ".gguf"


def check_adapter(request: LoRARequest, arch: ModelArchConfig, max_rank: int) -> AdapterConfig:
    """The adapter's rank and scale, read from its config or header (no weights); a ValueError
    naming the field, key or tensor this engine cannot apply to this base model."""
    if is_gguf_adapter(request):
        return check_gguf_adapter(request, arch, max_rank)
    return peft.check_adapter(request, arch, max_rank)


def load_adapter(request: LoRARequest, arch: ModelArchConfig, max_rank: int,
                 device: Optional[torch.device] = None) -> LoRAAdapter:
    """The adapter's checked float32 matrices."""
    if is_gguf_adapter(request):
        return load_gguf_adapter(request, arch, max_rank, device)
    return peft.load_adapter(request, arch, max_rank, device)
