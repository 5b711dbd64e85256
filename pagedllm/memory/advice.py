"""The ways out when a model does not fit: each weight format on this machine, or split over
machines like it, with the planner's expected one-stream decode speed.

A way is offered only where the planner itself (memory.plan_memory, plan_pipeline_memory with
one memory like this one per rank) would plan it, so the machine count, pipeline_parallel_size
and tensor_parallel_size printed are the ones the engine would accept and fit. Formats not at
hand (a GGUF of an HF checkpoint) are sized from the config's shapes at their bits a weight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from pagedllm.config import ModelArchConfig
from pagedllm.distributed.stage import PipelineStage, even_partition
from pagedllm.memory.decode_speed import (pipeline_tok_per_s, rank_seconds,
                                          tensor_parallel_tok_per_s)
from pagedllm.memory.footprint import ModelFootprint, footprint, regrouped_bytes
from pagedllm.memory.plan import (InsufficientMemoryError, MemoryPlan, PlanLimits, plan_memory,
                                  plan_pipeline_memory)
from pagedllm.memory.weight_layout import WeightLayout
from pagedllm.platforms.interface import MemoryInfo


@dataclass(frozen=True)
class WeightFormat:
    """A way to hold a model's weights, in bits a weight of each part."""

    name: str  # short: "Q4_K_M", for JSON and tests
    label: str  # what the advice calls it
    how: str  # what to ask for, when the label does not say it
    layer_bits: float  # a decoder layer's matrices
    embed_bits: float
    head_bits: float
    # made at load from a float checkpoint (int8/int4), slice by slice as it is read: the
    # load's peak holds the blocks twice (made, then regrouped for the kernels), as a GGUF's
    at_load: bool = False
    itemsize: int = 4  # bytes a value of the KV cache, norms and biases
    block: int = 1  # values a block along a row: a TP split of the MLP falls on multiples
    gguf: bool = False  # blocks that can be mapped from a file (mmap_weights)
    tag: str = ""  # the quantization tag of a Hub reference (repo:TAG)


# A GGUF's bits a weight are llama.cpp's mixes: Q4_K_M keeps most matrices in Q4_K (4.5 bits)
# and half the layers' ffn_down / attn_v in Q6_K, the head in Q6_K (Qwen2-7B-Instruct's
# q4_k_m file: 4.68 GB, these give 4.71); Q2_K mostly Q2_K with some Q3_K/Q4_K (its q2_k file:
# 3.02 GB, these give 3.04). int4 at load is Q4_1 (5 bits) with the embedding and head in Q8_0.
FORMATS = (
    WeightFormat("Q4_K_M", "a 4-bit GGUF (Q4_K_M)", "", 4.85, 4.5, 6.5625, block=256,
                 gguf=True, tag="Q4_K_M"),
    WeightFormat("Q2_K", "a 2-bit GGUF (Q2_K)", "", 2.95, 2.625, 6.5625, block=256, gguf=True,
                 tag="Q2_K"),
    WeightFormat("int4", "int4 at load", "quantization='int4': Q4_1 blocks", 5.0, 8.5, 8.5,
                 at_load=True, block=32),
    WeightFormat("int8", "int8 at load", "quantization='int8': Q8_0 blocks", 8.5, 8.5, 8.5,
                 at_load=True, block=32),
    WeightFormat("bf16", "bf16 weights", "dtype='bfloat16'", 16, 16, 16, itemsize=2),
)
TESTED = "Q4_K_M"  # the seed user's way: tests/platforms/test_small_machine.py runs it at -pp 2

# Hub GGUF repositories of known shapes, for "where to get it" (the repo:TAG form locate_model
# accepts): (architecture, hidden, layers, intermediate, vocab) -> (model, repository)
KNOWN_GGUF_REPOS = {
    ("qwen2", 3584, 28, 18944, 152064): ("Qwen2-7B-Instruct", "Qwen/Qwen2-7B-Instruct-GGUF"),
}

# Known sizes per family, for "a smaller model of the same family": (name, parameters)
FAMILY_SIZES = {
    "qwen2": [("Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen2.5-1.5B-Instruct", 1.54e9),
              ("Qwen2.5-3B-Instruct", 3.09e9), ("Qwen2.5-7B-Instruct", 7.62e9)],
    "qwen3": [("Qwen3-0.6B", 0.75e9), ("Qwen3-1.7B", 2.03e9), ("Qwen3-4B", 4.02e9),
              ("Qwen3-8B", 8.19e9)],
    "llama": [("SmolLM2-135M-Instruct", 0.135e9), ("SmolLM2-360M-Instruct", 0.36e9),
              ("Llama-3.2-1B-Instruct", 1.24e9), ("SmolLM2-1.7B-Instruct", 1.71e9),
              ("Llama-3.2-3B-Instruct", 3.21e9), ("Llama-3.1-8B-Instruct", 8.03e9)],
}


@dataclass(frozen=True)
class Way:
    """One way a format runs: on how many machines like this one, split how, how fast."""

    fmt: str  # WeightFormat.name, or "as is" for the checkpoint itself
    pipeline_parallel_size: int
    tensor_parallel_size: int
    mapped: bool  # its GGUF blocks mapped from a file
    tok_per_s: float  # the bandwidth model's one-stream decode estimate
    page_cache_share: Optional[float] = None  # of the mapped blocks, on one machine

    @property
    def machines(self) -> int:
        """Machines like this one it needs: one rank each."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def as_dict(self) -> dict:
        """For doctor --json."""
        return {"format": self.fmt, "machines": self.machines,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "tensor_parallel_size": self.tensor_parallel_size, "mapped": self.mapped,
                "tok_per_s": round(self.tok_per_s, 2), "page_cache_share": self.page_cache_share}


@dataclass(frozen=True)
class FormatWays:
    """A format's ways: on one machine, else the fewest pipeline or tensor parallel ranks."""

    fmt: WeightFormat
    run_bytes: int  # the weights it holds when running
    load_bytes: int  # the load's peak: the weights, twice where the load regroups them
    one: Optional[Way] = None
    pp: Optional[Way] = None
    tp: Optional[Way] = None
    tp_sizes: tuple[int, ...] = ()  # the sizes its shapes split into

    @property
    def best(self) -> Optional[Way]:
        """Its fastest way."""
        ways = [w for w in (self.one, self.pp, self.tp) if w is not None]
        return max(ways, key=lambda w: w.tok_per_s) if ways else None


def format_layout(arch: ModelArchConfig, fmt: WeightFormat) -> WeightLayout:
    """The weights of `arch` in fmt by stage, from the config's shapes, as they run."""
    h, layers = arch.hidden_size, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    vectors = 2 * h + (q + 2 * kv if arch.attention_bias else 0) + (
        2 * arch.head_dim if arch.qk_norm else 0) + (2 * h if arch.gemma is not None else 0)
    embed = arch.vocab_size * h
    head = 0 if arch.tie_word_embeddings else embed
    matrices = (arch.num_params() - embed - head - h) // layers - vectors
    mlp = 3 * h * arch.intermediate_size if arch.moe is None else 0

    def size(n: int, bits: float) -> int:
        return int(n * bits / 8)

    itemsize = fmt.itemsize
    # a tied embedding is also the head: the mixes keep it at the head's bits
    embed_bits = fmt.head_bits if arch.tie_word_embeddings else fmt.embed_bits
    blocks = (size(matrices, fmt.layer_bits), size(embed, embed_bits), size(head, fmt.head_bits))
    mapped = fmt.gguf
    return WeightLayout((blocks[0] + vectors * itemsize,) * layers, blocks[1],
                        blocks[2] + h * itemsize, 0,
                        (blocks[0],) * layers if mapped else (), blocks[1] if mapped else 0,
                        blocks[2] if mapped else 0, arch.tie_word_embeddings,
                        size(mlp, fmt.layer_bits) * layers, fmt.block)


def format_footprints(arch: ModelArchConfig, num_params: int, fmt: WeightFormat,
                      source: str) -> list[ModelFootprint]:
    """What the engine plans for fmt, in the order it tries: in anonymous memory (a GGUF's
    kept blocks read, then regrouped: held twice at the load's peak), then its blocks mapped."""
    layout = format_layout(arch, fmt)
    fp = footprint(arch, num_params, fmt.itemsize, fmt.name, source, layout.total, 0, layout)
    if fmt.at_load:
        return [replace(fp, load_extra_bytes=regrouped_bytes(layout, at_load=True))]
    if not fmt.gguf:
        return [fp]
    mapped = footprint(arch, num_params, fmt.itemsize, fmt.name, source, layout.total,
                       layout.mapped_total, layout)
    return [replace(fp, load_extra_bytes=layout.mapped_total), mapped]


def tp_sizes(arch: ModelArchConfig, block: int = 1) -> tuple[int, ...]:
    """tensor_parallel_size values the shapes split into: each divides the attention heads, the
    KV heads and the vocabulary, and the MLP's rows (at whole blocks of `block` values)."""
    mlp_parts = arch.intermediate_size // block
    return tuple(n for n in range(2, arch.num_key_value_heads + 1)
                 if arch.num_attention_heads % n == 0 and arch.num_key_value_heads % n == 0
                 and arch.vocab_size % n == 0 and mlp_parts >= n
                 and (block > 1 or arch.intermediate_size % n == 0))


def _plan(fps: Sequence[ModelFootprint], mem: MemoryInfo, pp: int, tp: int,
          limits: PlanLimits) -> Optional[tuple[ModelFootprint, MemoryPlan]]:
    """The first of fps the planner fits with pp x tp ranks, each on a machine like this one."""
    for fp in fps:
        try:
            if pp == tp == 1:
                return fp, plan_memory(fp, mem, limits)
            return fp, plan_pipeline_memory(
                fp, pp, mem, limits, [mem] * (pp * tp), tp, partition=even_partition(
                    fp.arch.num_hidden_layers, pp))
        except InsufficientMemoryError:
            continue
    return None


def _speed(run: WeightLayout, plan: MemoryPlan, pp: int, tp: int) -> float:
    """The bandwidth model's tok/s of a way: each rank reads its running weights a token (the
    head once, the embedding only a row), and re-reads what its page cache lacks."""
    head = run.embedding if run.tied else run.head
    ranks = plan.ranks or (plan,)
    if tp > 1:
        reread = max(r.reread_bytes_per_step() for r in ranks)
        return tensor_parallel_tok_per_s(rank_seconds((sum(run.layers) + head) // tp, reread),
                                         len(run.layers))
    stages = []
    for r in range(pp):
        s = PipelineStage.of_rank(len(run.layers), r, pp, even_partition(len(run.layers), pp))
        read = sum(run.layers[s.start_layer:s.end_layer]) + (head if s.is_last else 0)
        stages.append(rank_seconds(read, ranks[r].reread_bytes_per_step()))
    return pipeline_tok_per_s(stages)


def _way(name: str, fps: Sequence[ModelFootprint], run: WeightLayout, mem: MemoryInfo, pp: int,
         tp: int, limits: PlanLimits) -> Optional[Way]:
    got = _plan(fps, mem, pp, tp, limits)
    if got is None:
        return None
    fp, plan = got
    share = None
    if fp.mapped_bytes and pp == tp == 1:
        share = min(1.0, plan.expected_page_cache() / fp.mapped_bytes)
    return Way(name, pp, tp, bool(fp.mapped_bytes), _speed(run, plan, pp, tp), share)


def split_ways(name: str, fps: Sequence[ModelFootprint], run: WeightLayout, mem: MemoryInfo,
               limits: PlanLimits,
               tp_options: Sequence[int]) -> tuple[Optional[Way], Optional[Way]]:
    """The fewest pipeline ranks (at most one a layer) and the fewest tensor parallel ranks
    (of tp_options) the planner fits, each rank on a machine like this one; None: none fits."""
    layers = fps[0].arch.num_hidden_layers
    pp = next((w for n in range(2, layers + 1)
               if (w := _way(name, fps, run, mem, n, 1, limits)) is not None), None)
    tp = next((w for n in tp_options if (w := _way(name, fps, run, mem, 1, n, limits))
               is not None), None)
    return pp, tp


def format_ways(arch: ModelArchConfig, num_params: int, fmt: WeightFormat, source: str,
                mem: MemoryInfo, limits: PlanLimits) -> FormatWays:
    """How fmt runs on machines like this one: on one, else split."""
    fps = format_footprints(arch, num_params, fmt, source)
    run = format_layout(arch, fmt)
    out = FormatWays(fmt, run.total, run.total * (2 if fmt.at_load else 1),
                     tp_sizes=tp_sizes(arch, fmt.block))
    one = _way(fmt.name, fps, run, mem, 1, 1, limits)
    if one is not None:
        return replace(out, one=one)
    pp, tp = split_ways(fmt.name, fps, run, mem, limits, out.tp_sizes)
    return replace(out, pp=pp, tp=tp)


def all_format_ways(arch: ModelArchConfig, num_params: int, source: str, mem: MemoryInfo,
                    limits: PlanLimits) -> list[FormatWays]:
    """Every format's ways (FORMATS' order)."""
    return [format_ways(arch, num_params, f, source, mem, limits) for f in FORMATS]


def tested_way(ways: Sequence[FormatWays]) -> Optional[Way]:
    """The seed user's way, when it fits: a Q4_K_M GGUF on one machine like this one, else
    with pipeline_parallel_size=2 over two (one rank each)."""
    tested = next(w for w in ways if w.fmt.name == TESTED)
    if tested.one is not None:
        return tested.one
    return tested.pp if tested.pp is not None and tested.pp.pipeline_parallel_size == 2 else None


def fastest_way(ways: Sequence[FormatWays]) -> Optional[Way]:
    """The way of any format the bandwidth model expects to decode fastest."""
    best = [w.best for w in ways if w.best is not None]
    return max(best, key=lambda w: w.tok_per_s) if best else None


def gguf_hub_ref(arch: ModelArchConfig, tag: str) -> Optional[str]:
    """The Hub reference of the official GGUF of a known model's shapes (repo:TAG), else None."""
    key = (arch.architecture, arch.hidden_size, arch.num_hidden_layers, arch.intermediate_size,
           arch.vocab_size)
    known = KNOWN_GGUF_REPOS.get(key)
    return f"{known[1]}:{tag}" if known else None
