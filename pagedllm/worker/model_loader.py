"""load_model: checkpoint -> a ready nn.Module on the engine's platform.

    resolve the checkpoint -> plan which GGUF matrices keep their blocks -> build the plain model
    (on the meta device, inside the platform's build context) -> swap in block-format modules ->
    load the weights by checkpoint name (a float checkpoint's int8/int4 blocks quantized slice by
    slice as they are read) -> refuse NaN/inf norms and biases -> regroup blocks for the CPU
    kernels

With config.mmap_weights, the kept blocks instead come regrouped from a cache file, mapped
(x8_weight_file.py): only the float tensors are read into memory.
"""
from __future__ import annotations

import logging
import mmap
import time
from typing import Callable, Optional

import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.layers.custom_op import build_context
from pagedllm.layers.ggml_linear import X8Slot, pack_x8, x8_slots
from pagedllm.layers.quantization import QuantPlan, block_quantizers, float_quant_plan
from pagedllm.layers.rotary import rope_summary
from pagedllm.loader.checkpoint import Checkpoint, load_weights, resolve_checkpoint
from pagedllm.loader.gguf.weights import GGUFWeightReader, gguf_quant_plan
from pagedllm.loader.metadata import gguf_kept_embedding
from pagedllm.loader.row_encoding import EncodedRows
from pagedllm.loader.weight_checks import check_finite_vectors
from pagedllm.memory.weight_layout import quantized_at_load
from pagedllm.models.pipeline import held_elsewhere
from pagedllm.models.registry import build_model, model_class_for
from pagedllm.models.tensor_parallel import add_collectives
from pagedllm.platforms.interface import fmt_bytes
from pagedllm.platforms.malloc import trim_freed_memory
from pagedllm.worker.x8_weight_file import cache_path, map_slots

logger = logging.getLogger("pagedllm")


def _block_plan(ckpt: Checkpoint, config: EngineConfig) -> QuantPlan:
    """Which matrices hold blocks: a GGUF's kept ones (all the kernels run with "gguf"; with
    "none", the token embedding only: gguf_kept_embedding, its lookup is exact either way); a
    float checkpoint's with int8/int4, made at load (planned on the model built on meta)."""
    quant, kernel_types = config.quantization, config.platform.block_types()
    if ckpt.kind != "gguf":
        if not quantized_at_load(ckpt, quant):
            return {}
        with torch.device("meta"):
            shape = model_class_for(config.arch)(config.arch, config.scheduler.max_model_len)
        return float_quant_plan(shape, quant)
    if quant == "gguf":
        return gguf_quant_plan(ckpt.path, kernel_types)
    embed = gguf_kept_embedding(ckpt, kernel_types) if quant == "none" else None
    return {} if embed is None else {"model.embed_tokens": embed}


def _encoded_at_load(model: nn.Module, params: dict[str, torch.Tensor], dtype: torch.dtype
                     ) -> dict[str, torch.Tensor]:
    """params with each block weight made at load behind EncodedRows: the loader's float rows
    are quantized into it as they are copied (the float matrix never exists whole)."""
    quantizers = block_quantizers(model)
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if id(t) in quantizers:
            cols, encode = quantizers[id(t)]
            out[name] = EncodedRows(t, cols, dtype, encode)  # type: ignore[assignment]
        else:
            out[name] = t
    return out


def _load_file_backed(ckpt: Checkpoint, model: nn.Module, params: dict[str, torch.Tensor],
                      stage: Optional[PipelineStage], tp: Optional[TensorParallelRank]) -> None:
    """Read the float tensors; map the kept blocks, regrouped, from their cache file (written
    on the first load one matrix at a time; one file per pipeline stage and TP rank). The
    blocks' own params are never filled: their storage is released, so they take no memory."""
    if ckpt.kind != "gguf":
        raise ValueError("mmap_weights needs a GGUF checkpoint (its kept blocks are what is "
                         f"mapped); {ckpt.path} is a {ckpt.kind} checkpoint")
    slots = x8_slots(model)
    name_of = {id(t): name for name, t in params.items()}
    slot_names = {id(slot): name_of[id(slot.source)] for slot in slots}
    skip = None if stage is None else held_elsewhere(stage)
    parts = ([] if stage is None else [f"pp{stage.rank}-of-{stage.world_size}"]) + (
        [] if tp is None else [f"tp{tp.rank}-of-{tp.world_size}"])
    part = "-".join(parts) or "all"  # a stage's TP rank: "pp1-of-2-tp0-of-2"
    # planned on the params' shapes
    with GGUFWeightReader(ckpt.path, params, skip, model.checkpoint_shards) as reader:

        def free(slot: X8Slot) -> None:  # every holder of the param sees it emptied
            slot.source.data = torch.empty((0, slot.shape[1]), dtype=torch.uint8)

        for slot in slots:  # the model's own untouched buffers go now: load maps fresh ones
            free(slot)
        reader.load([n for n in reader.names() if n not in set(slot_names.values())])

        def load(slot: X8Slot) -> None:  # into pages of its own, unmapped again by free
            rows, cols = slot.shape
            buf = mmap.mmap(-1, max(1, rows * cols))
            slot.source.data = torch.frombuffer(buf, dtype=torch.uint8)[:rows * cols].view(rows, cols)
            reader.load([slot_names[id(slot)]], progress=False)

        mapped = map_slots(ckpt.path, part, slots, load, free)
    logger.info("%s of GGUF blocks mapped from %s (file-backed: the page cache holds them)",
                fmt_bytes(mapped), cache_path(ckpt.path, part))


def _skip(model: nn.Module, stage: Optional[PipelineStage]) -> Optional[Callable[[str], bool]]:
    """Checkpoint tensors not to read: another pipeline stage's, and those the model leaves
    unused (an encoder's next-sentence pooler)."""
    unused = getattr(model, "skips_checkpoint_tensor", None)
    elsewhere = None if stage is None else held_elsewhere(stage)
    if unused is None or elsewhere is None:
        return unused or elsewhere
    return lambda name: unused(name) or elsewhere(name)


def load_model(config: EngineConfig, stage: Optional[PipelineStage] = None,
               tp: Optional[TensorParallelRank] = None) -> nn.Module:
    """The model of config.model_path with its weights, on config.platform, ready to run; with
    a pipeline stage, only the modules and weights that stage holds; with a tensor parallel
    rank, its share of each layer, reading only that share of the checkpoint."""
    started = time.monotonic()
    platform, quant = config.platform, config.quantization
    device = platform.device()
    ckpt = resolve_checkpoint(config.model_path, config.hf_overrides)
    plan = _block_plan(ckpt, config)
    with build_context(platform, config.dtype):
        model = build_model(config.arch, config.scheduler.max_model_len, config.dtype, device, plan,
                            stage, tp)
    with torch.no_grad():
        params = model.checkpoint_params()
        if quantized_at_load(ckpt, quant):
            params = _encoded_at_load(model, params, config.dtype)
        if config.mmap_weights:
            _load_file_backed(ckpt, model, params, stage, tp)
        else:
            load_weights(ckpt, params, _skip(model, stage), model.checkpoint_shards)
        check_finite_vectors(params, ckpt.path)
    del params  # the loaded tensors: pack_x8 frees each as it regroups it
    if (quant != "none" or plan) and not config.mmap_weights:
        pack_x8(model)  # the eight-row layout of the CPU kernels
    if device.type == "cpu":
        # the load's transient copies (rows read, matrices before regrouping) are free now, but
        # the CPU platform's trim threshold (platforms/malloc.py) would keep them in the heap:
        # ~0.1-0.5 GiB of a bf16 checkpoint of the default model
        trim_freed_memory()
    if tp is not None:
        add_collectives(model, tp)  # last: they wrap whatever modules loading left
    details = (f", token embedding kept in {plan['model.embed_tokens'].name} blocks"
               if quant == "none" and plan else "")
    arch = config.arch
    rope = rope_summary(arch.rope_scaling, arch.max_position_embeddings,
                        config.scheduler.max_model_len)
    details += f", {rope}" if rope else ""
    if stage is not None:
        details += (f", pipeline stage {stage.rank + 1} of {stage.world_size}: layers "
                    f"{stage.start_layer}-{stage.end_layer - 1}")
    if tp is not None:
        details += f", tensor parallel rank {tp.rank + 1} of {tp.world_size}"
    logger.info("loaded %s (%s, %s, quantization %s%s) in %.1f s", ckpt.path,
                arch.architecture, str(config.dtype).removeprefix("torch."), quant, details,
                time.monotonic() - started)
    return model
