"""The adapters requests have named: each checked once against the base model, before its
request is queued, so that a bad adapter is a ValueError for its caller and never a failed
step."""
from __future__ import annotations

from typing import Any, Callable, Optional

from pagedllm.config import LoRAConfig, ModelArchConfig
from pagedllm.lora.peft import AdapterConfig
from pagedllm.lora.request import LoRARequest

# reads an adapter's config and tensor headers against the base (loader/lora_adapter.py)
AdapterCheck = Callable[[LoRARequest, ModelArchConfig, int], AdapterConfig]


class AdapterRegistry:
    """lora_int_id -> the LoRARequest first checked under it."""

    def __init__(self, arch: ModelArchConfig, config: Optional[LoRAConfig],
                 check: AdapterCheck) -> None:
        """config: the engine's LoRA options (None: enable_lora is off, every adapter refused);
        check: what reads an adapter of any format this engine reads."""
        self.arch, self.config, self._check = arch, config, check
        self.known: dict[int, LoRARequest] = {}

    def check(self, request: Any) -> Optional[LoRARequest]:
        """The request's adapter, checked (None: the base model); a ValueError naming the
        field or the adapter's tensor otherwise."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (pagedllm.lora.request), got "
                             f"{type(request).__name__}")
        if self.config is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True "
                             "(the command line: --enable-lora)")
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(f"lora_request.lora_int_id={request.lora_int_id} already names "
                                 f"the adapter at {known.lora_path!r}; give {request.lora_path!r} "
                                 "another id")
            return request
        self._check(request, self.arch, self.config.max_lora_rank)
        self.known[request.lora_int_id] = request
        return request

    def next_id(self) -> int:
        """An id no adapter has had: ids are never reused, so that a slot, a read copy or a
        prefix-cache block of an unloaded adapter can never serve another."""
        return max(self.known, default=0) + 1
