"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, a unique id > 0, and a local PEFT directory (adapter_config.json
    and adapter_model.safetensors) or llama.cpp GGUF LoRA file (.gguf). The id keys everything
    the engine keeps for it: its slot, its cached weights and its prefix-cache blocks, so one id
    is one adapter for the engine's life."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None  # vLLM's field: the server's model it adapts

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_request.lora_int_id must be an int >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must be the adapter's local directory "
                             f"or .gguf file, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """lora_int_id (vLLM's alias)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """lora_name (vLLM's alias)."""
        return self.lora_name

    @property
    def path(self) -> str:
        """lora_path (vLLM's alias)."""
        return self.lora_path
