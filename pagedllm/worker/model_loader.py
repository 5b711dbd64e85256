"""load_model: checkpoint -> a ready nn.Module on the engine's platform.

    resolve the checkpoint -> plan which GGUF matrices keep their blocks -> build the plain model
    (on the meta device, inside the platform's build context) -> swap in block-format modules ->
    load the weights by checkpoint name -> refuse NaN/inf norms and biases -> quantize a float
    model (int8/int4) -> regroup blocks for the CPU kernels
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.layers.custom_op import build_context
from pagedllm.layers.ggml_linear import pack_x8
from pagedllm.layers.quantization import QuantPlan, quantize_float_model
from pagedllm.layers.rotary import rope_summary
from pagedllm.loader.checkpoint import Checkpoint, load_weights, resolve_checkpoint
from pagedllm.loader.gguf_loader import gguf_quant_plan
from pagedllm.loader.metadata import gguf_kept_embedding
from pagedllm.loader.weight_checks import check_finite_vectors
from pagedllm.models.pipeline import held_elsewhere
from pagedllm.models.registry import build_model

logger = logging.getLogger("pagedllm")


def _block_plan(ckpt: Checkpoint, quant: str, kernel_types: frozenset) -> QuantPlan:
    """Which matrices keep their GGUF blocks: all the kernels run with "gguf"; with "none",
    the token embedding only (gguf_kept_embedding: its lookup is exact either way)."""
    if ckpt.kind != "gguf":
        return {}
    if quant == "gguf":
        return gguf_quant_plan(ckpt.path, kernel_types)
    embed = gguf_kept_embedding(ckpt, kernel_types) if quant == "none" else None
    return {} if embed is None else {"model.embed_tokens": embed}


def load_model(config: EngineConfig, stage: Optional[PipelineStage] = None) -> nn.Module:
    """The model of config.model_path with its weights, on config.platform, ready to run; with
    a pipeline stage, only the modules and weights that stage holds."""
    started = time.monotonic()
    platform, quant = config.platform, config.quantization
    device = platform.device()
    ckpt = resolve_checkpoint(config.model_path)
    plan = _block_plan(ckpt, quant, platform.block_types())
    with build_context(platform, config.dtype):
        model = build_model(config.arch, config.scheduler.max_model_len, config.dtype, device, plan,
                            stage)
    with torch.no_grad():
        params = model.checkpoint_params()
        load_weights(ckpt, params, None if stage is None else held_elsewhere(stage))
        check_finite_vectors(params, ckpt.path)
    if quant in ("int8", "int4"):
        quantize_float_model(model, quant)
    if quant != "none" or plan:
        pack_x8(model)  # the eight-row layout of the CPU kernels
    details = (f", token embedding kept in {plan['model.embed_tokens'].name} blocks"
               if quant == "none" and plan else "")
    arch = config.arch
    rope = rope_summary(arch.rope_scaling, arch.max_position_embeddings,
                        config.scheduler.max_model_len)
    details += f", {rope}" if rope else ""
    if stage is not None:
        details += (f", pipeline stage {stage.rank + 1} of {stage.world_size}: layers "
                    f"{stage.start_layer}-{stage.end_layer - 1}")
    logger.info("loaded %s (%s, %s, quantization %s%s) in %.1f s", ckpt.path,
                arch.architecture, str(config.dtype).removeprefix("torch."), quant, details,
                time.monotonic() - started)
    return model
