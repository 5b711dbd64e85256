"""A pipeline or tensor parallel rank's own check, where it runs, that its share fits there."""
from __future__ import annotations

from dataclasses import replace

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.metadata import checkpoint_num_params, gguf_tensors
from pagedllm.memory.advice_text import advise
from pagedllm.memory.footprint import footprint, regrouped_bytes, stage_footprint, tp_share
from pagedllm.memory.plan import MemoryPlan, PlanLimits, plan_memory
from pagedllm.memory.weight_layout import planned_weight_layout, quantized_at_load
from pagedllm.platforms.interface import MemoryInfo


def plan_rank_memory(config: EngineConfig, stage: PipelineStage, mem: MemoryInfo,
                     tp_size: int = 1) -> MemoryPlan:
    """Check, in a pipeline rank's own process and before it loads anything, that its share
    (its stage's, over tp_size tensor parallel ranks; config's planned KV blocks,
    max_model_len and mmap_weights) fits the memory it reads where it runs (its own cgroup or
    machine); InsufficientMemoryError names the rank, with the ways out."""
    ckpt = resolve_checkpoint(config.model_path, config.hf_overrides)
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    kept = config.platform.block_types() if ckpt.kind == "gguf" else frozenset()
    tensors = gguf_tensors(ckpt)  # read once, handed down
    layout = planned_weight_layout(ckpt, kept, config.quantization, itemsize, tensors)
    num_params, source = checkpoint_num_params(ckpt, tensors)
    name = str(config.dtype).removeprefix("torch.")
    fp = footprint(ckpt.arch, num_params, itemsize, name, source, layout.total,
                   layout.mapped_total if config.mmap_weights else 0, layout)
    if not config.mmap_weights:
        at_load = quantized_at_load(ckpt, config.quantization)
        fp = replace(fp, load_extra_bytes=regrouped_bytes(
            layout, at_load, one_matrix=config.quantization == "bf16"))
    sched = config.scheduler
    limits = PlanLimits(config.cache.block_size, sched.max_num_seqs,
                        sched.max_num_batched_tokens, sched.max_model_len,
                        num_blocks=config.cache.num_blocks)
    return plan_memory(tp_share(stage_footprint(fp, stage), tp_size), mem, limits, advise)
