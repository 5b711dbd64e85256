"""Memory planning as pure functions: what the model needs, what fits, and what to do if nothing does.

Everything here runs on metadata before a weight byte is read or downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from pagedllm.config import ModelArchConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.loader.metadata import WeightLayout
from pagedllm.platforms.interface import GiB, MemoryInfo, fmt_bytes

RUNTIME_OVERHEAD_BYTES = 384 * 1024 ** 2  # tokenizer, Python objects, allocator slack still to come
MEMORY_UTILIZATION = 0.92  # share of available memory the engine plans to use
DEFAULT_KV_CAP_BYTES = 1 * GiB  # the KV cache takes no more than this unless asked
MIN_MODEL_LEN = 2048  # a default max_model_len is shrunk to fit, but not below this
# the advice offers a GGUF with its blocks mapped from a file when the page cache would hold at
# least this share of them (below, each token re-reads too much from disk)
MAPPED_MIN_SHARE = 0.75
# what a re-read costs, for the warning of a forced mapped plan (mmap_weights=True): the rate at
# which page faults read the mapped blocks back (a 2-vCPU cloud VM's virtio disk read the
# regrouped file at 200-210 MB/s in 128 KiB-1 MiB O_DIRECT reads, docs/small-machine.md)
DISK_READ_BYTES_PER_S = 200_000_000
# what decoding keeps resident besides the weights and the KV cache (Python, torch, the
# tokenizer, a step's buffers) once planned: a 7B Q2_K engine decoding in a 3.49 GiB cgroup
# held 585 MiB anonymous = ~150 MiB before planning + 224 MiB of KV cache + ~210 MiB
# (docs/small-machine.md)
DECODE_RESIDENT_BYTES = 224 * 1024 ** 2
# (share of the mapped bytes the page cache is short of, share of them re-read each decode
# step), measured on that engine in cgroups of 3.00, 2.88 and 2.75 GiB: while the shortfall is
# small the kernel's LRU keeps a stable set and re-reads about the rest; beyond, pages are
# evicted before their next use and the re-read grows ~10x as fast, to all of them
REREAD_CURVE = ((0.0, 0.0), (0.069, 0.057), (0.123, 0.40), (0.172, 0.93), (0.18, 1.0))

class InsufficientMemoryError(ValueError):
    """The model cannot run in the memory available; the message says what would.

    machines: how many machines like this one would hold the checkpoint split, as
    {"pipeline_parallel_size": n, "tensor_parallel_size": m} (a value None: no split the
    shapes allow fits); ways: every weight format's ways out (advice.FormatWays)."""

    def __init__(self, message: str, machines: Optional[dict] = None,
                 page_cache: bool = False, ways: tuple = ()) -> None:
        super().__init__(message)
        self.machines = machines or {}
        self.page_cache = page_cache  # the blocks would be mapped, but the page cache is short
        self.ways = ways


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

    @property
    def layers(self) -> int:
        """Decoder layers whose KV cache this footprint holds."""
        return self.arch.num_hidden_layers if self.num_layers is None else self.num_layers

    @property
    def max_len_supported(self) -> int:
        """Positions the model was trained for (a sliding window does not cut them: its layers
        attend over the window, and the cache still holds the whole sequence)."""
        return self.arch.max_position_embeddings


@dataclass(frozen=True)
class MemoryPlan:
    """The sizes chosen for this engine, and the numbers behind them."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    weight_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    overhead_bytes: int
    available: MemoryInfo
    mapped_bytes: int = 0  # block weights mapped from a file: they live in the page cache
    where: str = ""  # the pipeline rank(s) planned, when split; "" for one process
    ranks: tuple["MemoryPlan", ...] = ()  # each rank's own plan, when each has its own memory

    def page_cache_room(self) -> int:
        """Bytes of the planned memory left for the page cache to hold mapped weights: the
        planner's cautious share, which its own choice to map them follows."""
        used = self.weight_bytes + self.kv_cache_bytes + self.activation_bytes + self.overhead_bytes
        return max(0, int(self.available.available_bytes * MEMORY_UTILIZATION) - used)

    def mapped_tight(self) -> bool:
        """Whether the planner would refuse to map these weights by itself (the page cache it
        plans holds under MAPPED_MIN_SHARE of them); mmap_weights=True maps them anyway."""
        room = self.page_cache_room()
        return bool(self.mapped_bytes) and room < MAPPED_MIN_SHARE * self.mapped_bytes

    def expected_page_cache(self) -> int:
        """Bytes of page cache a decode step of one sequence finds for the mapped weights: the
        kernel fills the cgroup (or machine) to its limit with file pages, not to the plan's
        share, beside what decoding keeps resident (measured, DECODE_RESIDENT_BYTES)."""
        resident = self.weight_bytes + self.kv_cache_bytes + DECODE_RESIDENT_BYTES
        return max(0, self.available.available_bytes - resident)

    def reread_bytes_per_step(self) -> int:
        """Bytes of the mapped weights each decode step reads from disk again: every step reads
        all of them in the same order, and what the page cache is short of them costs
        REREAD_CURVE's share (measured)."""
        if not self.mapped_bytes:
            return 0
        short = max(0, self.mapped_bytes - self.expected_page_cache()) / self.mapped_bytes
        return int(self.mapped_bytes * _interpolate(REREAD_CURVE, short))

    def mapped_note(self) -> str:
        """What the mapped weights cost, or "" when none are mapped."""
        if not self.mapped_bytes:
            return ""
        cache = self.expected_page_cache()
        if cache >= self.mapped_bytes:
            return (f"; GGUF blocks {fmt_bytes(self.mapped_bytes)} mapped from a file, and the "
                    f"page cache has room for all of them (~{fmt_bytes(cache)} when decoding)")
        return (f"; GGUF blocks {fmt_bytes(self.mapped_bytes)} mapped from a file, of which the "
                f"page cache can hold ~{fmt_bytes(cache)} when decoding: each decode step "
                f"re-reads ~{fmt_bytes(self.reread_bytes_per_step())} from disk")

    def reread_warning(self) -> str:
        """The warning of a mapped plan the planner would not choose (mmap_weights=True): the
        expected re-read per step, and the decode rate it allows at DISK_READ_BYTES_PER_S."""
        reread = self.reread_bytes_per_step()
        note = (f"each decode step is expected to re-read ~{reread / 2**20:.0f} MiB/step from "
                f"disk: at most ~{DISK_READ_BYTES_PER_S / max(1, reread):.1f} tok/s per sequence "
                f"at {DISK_READ_BYTES_PER_S / 1e6:.0f} MB/s of disk reads" if reread else
                "decoding should find them all in the page cache, but a longer prompt or more "
                "sequences leave it less")
        return (f"mmap_weights=True{_where_of(self.where)}: the planner would not map the "
                f"{fmt_bytes(self.mapped_bytes)} of GGUF blocks (it plans ~"
                f"{fmt_bytes(self.page_cache_room())} of page cache for them, under "
                f"{MAPPED_MIN_SHARE:.0%}); the page cache can hold ~"
                f"{fmt_bytes(self.expected_page_cache())} when decoding, so {note}")

    def summary(self) -> str:
        """One log line (one per rank when each rank has its own memory)."""
        if self.ranks:
            return "\n".join(r.summary() for r in self.ranks) + (
                f"\nevery rank holds the same {self.num_blocks} KV blocks (the fewest any rank "
                f"fits) and max_model_len {self.max_model_len}")
        where = f" ({self.where})" if self.where else ""
        return (f"memory plan{where}: weights {fmt_bytes(self.weight_bytes)}{self.mapped_note()}, KV cache "
                f"{fmt_bytes(self.kv_cache_bytes)} ({self.num_blocks} blocks of {self.block_size}"
                f" = {self.num_blocks * self.block_size} tokens), activations "
                f"{fmt_bytes(self.activation_bytes)}, runtime {fmt_bytes(self.overhead_bytes)}; "
                f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}; "
                "preemption recomputes (no swap space); "
                f"available {fmt_bytes(self.available.available_bytes)} ({self.available.source})")


def kv_bytes_per_token(arch: ModelArchConfig, itemsize: int) -> int:
    """K and V of one token across all layers."""
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize


def footprint(arch: ModelArchConfig, num_params: int, itemsize: int, dtype_name: str,
              source: str, weight_bytes: Optional[int] = None,
              mapped_bytes: int = 0, layout: Optional[WeightLayout] = None) -> ModelFootprint:
    """A model's needs when its weights are held in a dtype of `itemsize` bytes (or take
    weight_bytes when some stay quantized, mapped_bytes of them from a file); layout: the
    weights by layer, which splits over pipeline ranks need."""
    resident = num_params * itemsize if weight_bytes is None else weight_bytes
    return ModelFootprint(arch, num_params, resident - mapped_bytes,
                          kv_bytes_per_token(arch, itemsize), dtype_name, source, mapped_bytes,
                          layout)


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


def plan_memory(fp: ModelFootprint, mem: MemoryInfo, *, block_size: int,
                max_model_len: Optional[int], max_num_seqs: int, max_num_batched_tokens: int,
                kv_cache_bytes: Optional[int] = None, num_blocks: Optional[int] = None,
                overhead_bytes: int = RUNTIME_OVERHEAD_BYTES,
                mapped_forced: bool = False, advise: bool = True) -> MemoryPlan:
    """Choose KV blocks and max_model_len that fit; explicit values win if they fit, else explain.
    mapped_forced (mmap_weights=True): a mapped plan whose page cache is short is kept, and its
    reread_warning() says what it costs, instead of refused. advise=False: a refusal says only
    why (the advice itself plans its ways with it)."""
    if max_model_len is not None and max_model_len > fp.max_len_supported:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model supports "
                         f"({fp.max_len_supported} positions)")
    block_bytes = fp.kv_bytes_per_token * block_size
    budget = int(mem.available_bytes * MEMORY_UTILIZATION)
    overhead_bytes *= fp.processes
    base_act = activation_bytes(fp, max_num_batched_tokens, max_num_seqs, 0)
    # the length a default plan may shrink to: one sequence of this must fit
    short_len = max_model_len or min(MIN_MODEL_LEN, fp.max_len_supported)

    def refusal(of: ModelFootprint, need_len: int, why: str = "",
                page_cache: bool = False) -> InsufficientMemoryError:
        """why (a first line, or none), then the advice for `of` needing need_len tokens and
        the machines a split would need."""
        if not advise:
            return InsufficientMemoryError(why or "the model does not fit in memory",
                                           page_cache=page_cache)
        # the advice plans its ways with this module: imported here, where it is needed
        from pagedllm.worker.advice_text import advise as advice_for

        got = advice_for(of, mem, budget, overhead_bytes, base_act, need_len, block_size,
                         max_num_batched_tokens, max_num_seqs)
        return InsufficientMemoryError(why + got.text, got.machines, page_cache, got.ways)

    load_peak = fp.weight_bytes + fp.load_extra_bytes + overhead_bytes
    if fp.load_extra_bytes and load_peak > budget:
        raise refusal(fp, short_len,
                      f"loading does not fit in memory{_where(fp)}: the GGUF's "
                      f"{fmt_bytes(fp.load_extra_bytes)} of kept blocks are read, then regrouped "
                      f"for the kernels, and the load peaks near {fmt_bytes(load_peak)} with the "
                      f"runtime; mapped from a file (mmap_weights) they are regrouped into it "
                      f"instead\n")
    # decode gathers one layer's context: 1/num_layers of the cache on top of the cache itself
    kv_share = 1 + fp.processes / max(1, fp.layers)
    free_for_kv = max(0, int((budget - fp.weight_bytes - overhead_bytes - base_act) / kv_share))
    want_len = max_model_len or fp.max_len_supported
    explicit_cache = num_blocks is not None or kv_cache_bytes is not None
    if num_blocks is None:
        one_seq = want_len * fp.kv_bytes_per_token  # the cap never cuts one full-length sequence
        default = min(free_for_kv, max(DEFAULT_KV_CAP_BYTES, one_seq), one_seq * max_num_seqs)
        if fp.mapped_bytes:  # leave the page cache room for the mapped weights first
            short = short_len * fp.kv_bytes_per_token
            default = min(default, free_for_kv, max(short, free_for_kv - fp.mapped_bytes))
        num_blocks = (kv_cache_bytes if kv_cache_bytes is not None else default) // block_bytes
    cache_tokens = num_blocks * block_size
    min_len = max_model_len or (1 if explicit_cache else min(MIN_MODEL_LEN, want_len))
    if num_blocks * block_bytes > free_for_kv or (not explicit_cache and cache_tokens < min_len):
        raise refusal(fp, min_len if not explicit_cache else max(1, cache_tokens))
    if cache_tokens < min_len:
        raise ValueError(f"max_model_len={min_len} does not fit the KV cache ({num_blocks} blocks "
                         f"of {block_size} = {cache_tokens} tokens); lower max_model_len or "
                         "raise kv_cache_memory_bytes")
    kv_bytes = num_blocks * block_bytes
    plan = MemoryPlan(num_blocks, block_size, min(want_len, cache_tokens), max_num_seqs,
                      fp.weight_bytes, kv_bytes,
                      activation_bytes(fp, max_num_batched_tokens, max_num_seqs, kv_bytes),
                      overhead_bytes, mem, fp.mapped_bytes, fp.where)
    room = plan.page_cache_room()
    if plan.mapped_tight() and not mapped_forced:
        anon = replace(fp, weight_bytes=fp.weight_bytes + fp.mapped_bytes, mapped_bytes=0)
        reread = plan.reread_bytes_per_step()
        cost = (f"each decode step would re-read ~{fmt_bytes(reread)} from disk" if reread else
                "decoding may still find them all in the page cache")
        raise refusal(anon, short_len,
                      f"the GGUF's blocks do not fit in memory{_where(fp)}, and mapped from a "
                      f"file (mmap_weights) the page cache could hold only ~{fmt_bytes(room)} of "
                      f"their {fmt_bytes(fp.mapped_bytes)} ({room / fp.mapped_bytes:.0%}; "
                      f"pagedllm maps them from {MAPPED_MIN_SHARE:.0%}): {cost}; "
                      f"mmap_weights=True maps them anyway\n",
                      page_cache=True)
    return plan


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
    return replace(fp, weight_bytes=size - mapped, mapped_bytes=mapped,
                   load_extra_bytes=blocks if fp.load_extra_bytes else 0,
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


def plan_pipeline_memory(fp: ModelFootprint, world_size: int, mem: MemoryInfo,
                         rank_mems: Optional[Sequence[MemoryInfo]] = None,
                         tp_size: int = 1, partition: Optional[Sequence[int]] = None,
                         **kwargs) -> MemoryPlan:
    """plan_memory for world_size pipeline stages of tp_size tensor parallel ranks each. Ranks
    that share this machine's memory (rank_mems None) are planned as the sum of their shares
    against `mem`; ranks that each have their own memory (a cgroup or a machine each:
    rank_mems[r], r the global rank) each plan their own share (their stage's, over tp_size),
    and all then take the fewest KV blocks and the shortest max_model_len any rank fits (every
    rank holds the same block ids). partition: layers per stage (else VLLM_PP_LAYER_PARTITION's
    or the even split)."""
    if rank_mems is None:
        return plan_memory(shared_footprint(fp, world_size, tp_size), mem, **kwargs)
    plans = []
    for r, rank_mem in enumerate(rank_mems):
        share = tp_share(stage_footprint(fp, PipelineStage.of_rank(
            fp.arch.num_hidden_layers, r // tp_size, world_size, partition)), tp_size)
        if tp_size > 1:  # the refusal names the rank, as its process's messages do
            share = replace(share, where=f"rank {r}, {share.where}")
        plans.append(plan_memory(share, rank_mem, **kwargs))  # a refusal names the rank
    tightest = min(plans, key=lambda p: p.num_blocks * p.block_size)
    max_len = min(p.max_model_len for p in plans)
    plans = [replace(p, num_blocks=tightest.num_blocks, max_model_len=max_len,
                     kv_cache_bytes=p.kv_cache_bytes // p.num_blocks * tightest.num_blocks)
             for p in plans]
    return replace(plans[0], ranks=tuple(plans), max_model_len=max_len,
                   num_blocks=tightest.num_blocks,
                   weight_bytes=max(p.weight_bytes for p in plans),
                   where=f"{len(rank_mems)} ranks, each in its own memory")


def _where(fp: ModelFootprint) -> str:
    """" (pipeline rank 1 of 2: layers 14-27, head)" for a share of the model, else ""."""
    return _where_of(fp.where)


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """The piecewise-linear curve through points (x ascending) at x, flat past its ends."""
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1]


def _where_of(where: str) -> str:
    return f" ({where})" if where else ""


def plan_rank_memory(config, stage: PipelineStage, mem: MemoryInfo,
                     tp_size: int = 1) -> MemoryPlan:
    """Check, in a pipeline rank's own process and before it loads anything, that its share
    (its stage's, over tp_size tensor parallel ranks; config's planned KV blocks,
    max_model_len and mmap_weights) fits the memory it reads where it runs (its own cgroup or
    machine); InsufficientMemoryError names the rank."""
    import torch

    from pagedllm.loader.checkpoint import resolve_checkpoint
    from pagedllm.loader.metadata import checkpoint_num_params, planned_weight_layout

    ckpt = resolve_checkpoint(config.model_path)
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    kept = config.platform.block_types() if ckpt.kind == "gguf" else frozenset()
    layout = planned_weight_layout(ckpt, kept, config.quantization, itemsize)
    num_params, source = checkpoint_num_params(ckpt)
    name = str(config.dtype).removeprefix("torch.")
    fp = footprint(ckpt.arch, num_params, itemsize, name, source, layout.total,
                   layout.mapped_total if config.mmap_weights else 0, layout)
    if not config.mmap_weights:
        fp = replace(fp, load_extra_bytes=layout.mapped_total)
    sched = config.scheduler
    return plan_memory(tp_share(stage_footprint(fp, stage), tp_size), mem,
                       block_size=config.cache.block_size,
                       max_model_len=sched.max_model_len, max_num_seqs=sched.max_num_seqs,
                       max_num_batched_tokens=sched.max_num_batched_tokens,
                       num_blocks=config.cache.num_blocks)
