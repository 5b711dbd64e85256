"""EngineArgs: the user-facing engine options, with vLLM's names."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch

from pagedllm.config import check_quantization

logger = logging.getLogger("pagedllm")

# vLLM options that tune GPUs or distributed execution; accepted and ignored here with a warning.
GPU_ONLY_ARGS = frozenset({
    "enforce_eager", "swap_space", "cpu_offload_gb",
    "tensor_parallel_size", "pipeline_parallel_size", "disable_custom_all_reduce",
    "max_seq_len_to_capture", "cuda_graph_sizes", "compilation_config",
    "distributed_executor_backend", "kv_cache_dtype", "disable_log_stats", "tokenizer_mode",
    "load_format", "download_dir", "tokenizer_revision",
    "enable_chunked_prefill", "disable_async_output_proc", "worker_cls", "hf_overrides",
    "mm_processor_kwargs", "limit_mm_per_prompt", "task", "num_scheduler_steps",
})

USAGE_CONTEXTS = ("llm", "api_server")

_IGNORED_WHY = {
    "swap_space": "preempted requests are recomputed, so no CPU swap space is reserved",
    "enforce_eager": "the engine always runs eagerly",
    "tensor_parallel_size": "this engine runs on one device",
}


@dataclass
class EngineArgs:
    """Options for building an engine; LLM(...) keyword arguments map onto these fields."""

    model: str
    tokenizer: Optional[str] = None
    dtype: Union[str, torch.dtype] = "auto"
    device: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None  # vLLM's name; here: number of KV blocks
    gpu_memory_utilization: Optional[float] = None  # GPU only: share of free device memory to use
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    trust_remote_code: bool = False
    revision: Optional[str] = None  # Hub branch, tag or commit
    gguf_file: Optional[str] = None  # a .gguf file inside a Hub repo
    model_source: Optional[str] = None  # None (Hugging Face, or env), "huggingface", "modelscope"
    # None: a GGUF keeps its quantized blocks on the CPU; "gguf", "int8", "int4" or "none"
    quantization: Optional[str] = None
    # who drives the engine, as vLLM's UsageContext: "llm" (offline LLM class) or "api_server";
    # it picks the default token budget (a server keeps steps short for time to first token)
    usage_context: str = "llm"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Split keyword arguments into ours, GPU-only ones (warned and dropped) and unknown ones."""
        known = {f.name for f in fields(cls)}
        ours = {}
        for key, value in kwargs.items():
            if key in known:
                ours[key] = value
            elif key in GPU_ONLY_ARGS:
                logger.warning("%s=%r is ignored: %s", key, value, _IGNORED_WHY.get(
                    key, "it has no effect on this engine"))
            else:
                raise TypeError(f"unexpected keyword argument {key!r}; supported: "
                                f"{', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **ours)

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        for name in ("max_num_seqs", "block_size", "max_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        gmu = self.gpu_memory_utilization
        if gmu is not None and (isinstance(gmu, bool) or not isinstance(gmu, (int, float))
                                or not 0 < gmu <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        if self.model_source not in (None, "huggingface", "modelscope"):
            raise ValueError("model_source must be 'huggingface' or 'modelscope', got "
                             f"{self.model_source!r}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got "
                             f"{self.usage_context!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
