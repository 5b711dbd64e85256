"""Adapters loaded and unloaded while the server runs (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), served only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, as vLLM
does: anyone who may call the API may otherwise make the server read files by path."""
from __future__ import annotations

import asyncio
import os
from typing import Optional

from pagedllm.entrypoints.openai.protocol import RequestBody
from pagedllm.entrypoints.openai.serving_common import OpenAIError, ServerContext, bad_request
from pagedllm.lora.request import LoRARequest

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    """Whether the environment turns the load/unload endpoints on (1 or true)."""
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter: a name for the adapter and its local PEFT directory (or a
    llama.cpp GGUF LoRA file)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter: the adapter's name (lora_int_id, when given, must match)."""

    lora_name: str
    lora_int_id: Optional[int] = None


async def load_lora_adapter(ctx: ServerContext, req: LoadLoRAAdapterRequest) -> str:
    """Check the adapter (off the event loop: it reads its files) and serve it by name."""
    engine = ctx.engine.engine
    if engine.config.lora is None:
        raise OpenAIError("the server was started without --enable-lora: no adapter can be "
                          "loaded", 400, "lora_name")
    name = req.lora_name
    if name in ctx.lora_modules or name in ctx.served_model_names:
        raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400,
                          "lora_name")
    try:
        request = LoRARequest(name, engine.adapters.next_id(), req.lora_path)
        await asyncio.to_thread(engine.adapters.check, request)
    except ValueError as err:
        raise bad_request(err) from None
    ctx.lora_modules[name] = request
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_lora_adapter(ctx: ServerContext, req: UnloadLoRAAdapterRequest) -> str:
    """Stop serving an adapter by name; requests already running with it finish."""
    request = ctx.lora_modules.get(req.lora_name)
    if request is None or req.lora_int_id not in (None, request.lora_int_id):
        raise OpenAIError(f"The lora adapter '{req.lora_name}' cannot be found.", 404,
                          "lora_name")
    del ctx.lora_modules[req.lora_name]
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
