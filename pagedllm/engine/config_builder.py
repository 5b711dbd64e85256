"""EngineArgs + checkpoint metadata -> EngineConfig: platform, dtype and a memory plan, before loading."""
from __future__ import annotations

import logging

import torch

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.platforms import Platform, resolve_dtype, resolve_platform
from pagedllm.platforms.gpu import TorchGpuPlatform
from pagedllm.platforms.interface import fmt_bytes
from pagedllm.worker.memory import InsufficientMemoryError, MemoryPlan, footprint, plan_memory

logger = logging.getLogger("pagedllm")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_engine_memory(args: EngineArgs, ckpt: Checkpoint, platform: Platform,
                       dtype: torch.dtype) -> tuple[MemoryPlan, torch.dtype]:
    """Size the KV cache and max_model_len from metadata; with dtype 'auto', fall back to a
    half-size dtype when float32 weights do not fit."""
    num_params, source = checkpoint_num_params(ckpt)
    mem = platform.memory()
    batched = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

    def plan(dt: torch.dtype) -> MemoryPlan:
        fp = footprint(ckpt.arch, num_params, torch.empty((), dtype=dt).element_size(),
                       _dtype_name(dt), source)
        return plan_memory(fp, mem, block_size=args.block_size, max_model_len=args.max_model_len,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
                           kv_cache_bytes=args.kv_cache_memory_bytes,
                           num_blocks=args.num_gpu_blocks_override)

    try:
        return plan(dtype), dtype
    except InsufficientMemoryError:
        half = torch.bfloat16 if torch.bfloat16 in platform.supported_dtypes() else None
        if str(args.dtype) != "auto" or dtype != torch.float32 or half is None:
            raise
        try:
            result = plan(half)
        except InsufficientMemoryError as err:
            raise InsufficientMemoryError(
                f"{err}\n  (float32, this device's default, needs twice the weights)") from None
        logger.warning("float32 weights do not fit in %s; using %s (dtype='auto')",
                       fmt_bytes(mem.available_bytes), _dtype_name(half))
        return result, half


def make_engine_config(args: EngineArgs, ckpt: Checkpoint) -> EngineConfig:
    """Resolve the platform and dtype, and plan memory, for a checkpoint."""
    choice = resolve_platform(args.device)
    if args.gpu_memory_utilization is not None:
        if isinstance(choice.platform, TorchGpuPlatform):
            choice.platform.utilization = args.gpu_memory_utilization
        else:
            logger.warning("gpu_memory_utilization=%s has no effect on the %s: memory is planned "
                           "from what the OS and cgroup allow", args.gpu_memory_utilization,
                           choice.platform.name)
    dtype = resolve_dtype(args.dtype, ckpt.arch.torch_dtype, choice.platform)
    mem_plan, dtype = plan_engine_memory(args, ckpt, choice.platform, dtype)
    logger.info("%s", mem_plan.summary())
    batched = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    return EngineConfig(
        model_path=str(ckpt.path), arch=ckpt.arch, dtype=dtype,
        device=str(choice.platform.device()),
        cache=CacheConfig(block_size=args.block_size, num_blocks=mem_plan.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=batched,
                                  max_model_len=mem_plan.max_model_len),
        seed=args.seed, max_logprobs=args.max_logprobs)


