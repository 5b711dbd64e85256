"""What a model needs, from metadata: its weights, KV cache and workspace, and a rank's share
of them under pipeline and tensor parallelism."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from pagedllm.config import LoRAConfig, ModelArchConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.memory.weight_layout import WeightLayout


@dataclass(frozen=True)
class ModelFootprint:
    """What a model needs, from metadata: parameters, bytes per weight, KV bytes per token."""

    arch: ModelArchConfig
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    dtype_name: str
    source: str  # where the parameter count came from
    mapped_bytes: int = 0  # block weights mapped from a file (page cache), not in weight_bytes
    layout: Optional[WeightLayout] = None  # the weights by layer, for splits over ranks
    num_layers: Optional[int] = None  # decoder layers held (KV cache, activations); None: all
    has_head: bool = True  # computes the logits (the last pipeline stage, or the whole model)
    processes: int = 1  # ranks that share this memory: a runtime and a workspace each
    where: str = ""  # which rank(s) this is, for messages: "" for the whole model
    # bytes a load holds twice at its peak: kept GGUF blocks in anonymous memory are read, then
    # regrouped for the kernels (a Qwen2-7B Q4_K stage of 2.13 GiB of blocks peaked at 4.5 GB)
    load_extra_bytes: int = 0
    # of weight_bytes, the LoRA adapters' (lora_bytes): spread evenly over the layers, so a
    # pipeline stage holds its layers' share (its rank reads its layers' part of each adapter)
    lora_bytes: int = 0

    @property
    def layers(self) -> int:
        """Decoder layers whose KV cache this footprint holds."""
        return self.arch.num_hidden_layers if self.num_layers is None else self.num_layers

    @property
    def max_len_supported(self) -> int:
        """Positions the model was trained for (a sliding window does not cut them: its layers
        attend over the window, and the cache still holds the whole sequence)."""
        return self.arch.max_positions


def kv_bytes_per_token(arch: ModelArchConfig, itemsize: int) -> int:
    """K and V of one token across all layers."""
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize


def footprint(arch: ModelArchConfig, num_params: int, itemsize: int, dtype_name: str,
              source: str, weight_bytes: Optional[int] = None,
              mapped_bytes: int = 0, layout: Optional[WeightLayout] = None,
              kv_itemsize: Optional[int] = None) -> ModelFootprint:
    """A model's needs when its weights are held in a dtype of `itemsize` bytes (or take
    weight_bytes when some stay quantized, mapped_bytes of them from a file); layout: the
    weights by layer, which splits over pipeline ranks need; kv_itemsize: the KV cache's bytes
    a value (default: itemsize, the cache in the compute dtype)."""
    resident = num_params * itemsize if weight_bytes is None else weight_bytes
    kv = kv_bytes_per_token(arch, itemsize if kv_itemsize is None else kv_itemsize)
    return ModelFootprint(arch, num_params, resident - mapped_bytes, kv, dtype_name, source,
                          mapped_bytes, layout)


def lora_bytes(arch: ModelArchConfig, lora: LoRAConfig, tp_size: int = 1) -> int:
    """Float32 bytes of the LoRA adapters at most: max_loras slots on the model plus
    max_cpu_loras adapters kept read, each max_lora_rank x (in + out) values per projection
    (q/k/v/o, and gate/up/down where a layer's feed-forward is dense). With tp_size ranks,
    tp_size times one rank's, so that a rank's share of the plan is what it holds: A whole and
    B's rows of its output rows (q/k/v, gate/up), or A's columns of its input columns and B
    whole (o_proj, down_proj)."""
    h, d, kv_heads = arch.hidden_size, arch.head_dim, arch.num_key_value_heads
    q = arch.num_attention_heads * d // tp_size
    kv = (kv_heads // tp_size if kv_heads >= tp_size else 1) * d  # one replicated KV head
    i = -(-arch.intermediate_size // tp_size)
    attention, mlp = 2 * (h + q) + 2 * (h + kv), 3 * (h + i)
    dense = sum(not (arch.moe is not None and arch.is_sparse_layer(n))
                for n in range(arch.num_hidden_layers))
    per_adapter = lora.max_lora_rank * (attention * arch.num_hidden_layers + mlp * dense) * 4
    return tp_size * (lora.max_loras + lora.cpu_loras) * per_adapter


def activation_bytes(fp: ModelFootprint, max_num_batched_tokens: int, max_num_seqs: int,
                     kv_cache_bytes: int) -> int:
    """Peak workspace of one step: hidden activations (in each rank), logits (where the head
    is), one layer's gathered K/V (in each rank)."""
    a = fp.arch
    width = 4 * a.hidden_size + _ffn_width(a) + (
        a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    hidden = max_num_batched_tokens * width * 4 * fp.processes
    # logits, float32 copy, softmax, filtered
    logits = max_num_seqs * a.vocab_size * 4 * 4 if fp.has_head else 0
    # decode reads one layer's context
    gathered = kv_cache_bytes * fp.processes // max(1, fp.layers)
    return hidden + logits + gathered


def _ffn_width(a: ModelArchConfig) -> int:
    """Float32 values per token of the widest feed-forward step: SwiGLU's gate, up and product;
    on a sparse layer, each of the k chosen experts' gathered input, gate/up, product and
    output, the shared expert's SwiGLU and the router's logits."""
    dense = 3 * a.intermediate_size
    moe = a.moe
    if moe is None:
        return dense
    shared = moe.shared_expert_intermediate_size or 0
    sparse = (moe.num_experts_per_tok * (2 * a.hidden_size + 3 * moe.moe_intermediate_size)
              + 3 * shared + moe.num_experts)
    return max(sparse, dense if moe.dense_layers else 0)


def regrouped_bytes(layout: WeightLayout, at_load: bool, one_matrix: bool = False) -> int:
    """Bytes a load holds twice at its peak, read and then regrouped for the kernels: a GGUF's
    kept blocks, or (at_load) every weight of a float checkpoint whose matrices are quantized
    as it loads (the blocks, and its norms counted with them). one_matrix (bf16 matrices at
    load): pack_x8 frees each matrix as it puts its regrouped copy, so the peak holds one
    matrix twice; bounded here by the largest of the embedding, the head and a whole layer.
    (pack_x8 does the same for the other formats, which are still planned at the whole: the
    safe side, left until their planned peaks are measured again.)"""
    if at_load and one_matrix:
        return max(layout.embedding, layout.head, max(layout.layers, default=0))
    return layout.total if at_load else layout.mapped_total


def _stage_extra(fp: ModelFootprint, size: int, blocks: int) -> int:
    """A stage's share of fp.load_extra_bytes: its kept GGUF blocks, or its share of the
    weights where all are regrouped (quantized at load)."""
    if not fp.load_extra_bytes:
        return 0
    layout = fp.layout
    if layout is None or layout.mapped_total or not layout.total:
        return blocks
    return -(-fp.load_extra_bytes * size // layout.total)


def stage_footprint(fp: ModelFootprint, stage: PipelineStage) -> ModelFootprint:
    """One pipeline rank's share of a whole-model footprint (which must carry its layout): its
    layers' weights (the embedding on the first, the final norm and head on the last), its
    layers' KV cache, its workspace and one runtime."""
    if fp.layout is None:
        raise ValueError("a footprint without a weight layout cannot be split into stages")
    size, blocks = fp.layout.stage_bytes(stage.start_layer, stage.end_layer, stage.is_first,
                                         stage.is_last)
    mapped = blocks if fp.mapped_bytes else 0
    n = len(stage.layers)
    lora = -(-fp.lora_bytes * n // fp.arch.num_hidden_layers)
    return replace(fp, weight_bytes=size - mapped + lora, mapped_bytes=mapped, lora_bytes=lora,
                   load_extra_bytes=_stage_extra(fp, size, blocks),
                   kv_bytes_per_token=fp.kv_bytes_per_token * n // fp.arch.num_hidden_layers,
                   num_layers=n, has_head=stage.is_last, processes=1,
                   where=f"pipeline rank {stage.rank} of {stage.world_size}: layers "
                         f"{stage.start_layer}-{stage.end_layer - 1}"
                         + (", embedding" if stage.is_first else "")
                         + (", head" if stage.is_last else ""))


def tp_share(fp: ModelFootprint, tp_size: int) -> ModelFootprint:
    """The largest tensor parallel rank's share of a footprint (a pipeline stage's, with TP x
    PP): its weights in the proportion the largest rank holds of the whole model (the layout's
    tp_rank_bytes: a 1/tp_size share, but the MLPs' uneven where kept blocks split at block
    boundaries), and its KV heads' cache (one head where they are fewer than the ranks)."""
    if tp_size == 1:
        return fp
    layout, kv = fp.layout, fp.arch.num_key_value_heads
    num, den = ((layout.tp_rank_bytes(tp_size, fp.arch.intermediate_size), layout.total)
                if layout is not None and layout.total else (1, tp_size))
    heads = kv // tp_size if kv >= tp_size else 1
    return replace(fp, weight_bytes=-(-fp.weight_bytes * num // den),
                   lora_bytes=-(-fp.lora_bytes * num // den),
                   mapped_bytes=-(-fp.mapped_bytes * num // den),
                   load_extra_bytes=-(-fp.load_extra_bytes * num // den),
                   kv_bytes_per_token=fp.kv_bytes_per_token * heads // kv,
                   where=f"{fp.where}, tensor parallel share of {tp_size}" if fp.where
                   else f"tensor parallel share of {tp_size}")


def shared_footprint(fp: ModelFootprint, world_size: int, tp_size: int = 1) -> ModelFootprint:
    """The footprint of world_size pipeline stages (of tp_size TP ranks each) that share one
    memory (processes on one machine): the sum of their stages' shares (a stage's TP ranks
    together hold the stage), with a runtime and a workspace per rank."""
    stages = [stage_footprint(fp, PipelineStage.of_rank(fp.arch.num_hidden_layers, r,
                                                       world_size)) for r in range(world_size)]
    ranks = world_size * tp_size
    return replace(fp, weight_bytes=sum(s.weight_bytes for s in stages),
                   mapped_bytes=sum(s.mapped_bytes for s in stages),
                   load_extra_bytes=sum(s.load_extra_bytes for s in stages),
                   kv_bytes_per_token=sum(s.kv_bytes_per_token for s in stages),
                   num_layers=fp.layers, has_head=True, processes=ranks,
                   where=f"{ranks} {'pipeline ' if tp_size == 1 else ''}ranks on this "
                         "machine, sharing its memory")
