"""Memory planning as pure functions: what fits, the sizes chosen, and why a model is refused.

Everything here runs on metadata before a weight byte is read or downloaded. What a model
needs is footprint.py's; the ways out of a refusal are the advisor's (advice_text.py), which
the caller passes in, so planning never imports the advice that plans with it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from pagedllm.distributed.stage import PipelineStage
from pagedllm.memory.footprint import (ModelFootprint, activation_bytes, shared_footprint,
                                       stage_footprint, tp_share)
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
    shapes allow fits); ways: every weight format's ways out (advice.FormatWays); both empty
    when no advisor was given. shortfall: what the planner was short of."""

    def __init__(self, message: str, machines: Optional[dict] = None,
                 page_cache: bool = False, ways: tuple = (),
                 shortfall: Optional["Shortfall"] = None) -> None:
        super().__init__(message)
        self.machines = machines or {}
        self.page_cache = page_cache  # the blocks would be mapped, but the page cache is short
        self.ways = ways
        self.shortfall = shortfall

    def with_note(self, note: str) -> "InsufficientMemoryError":
        """The same refusal with a line added to its message."""
        return InsufficientMemoryError(f"{self}\n{note}", self.machines, self.page_cache,
                                       self.ways, self.shortfall)


@dataclass(frozen=True)
class PlanLimits:
    """What a plan works under besides the memory: the sizes asked for (None: the planner
    chooses them), the runtime a process takes, and whether mapped weights are forced."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    num_blocks: Optional[int] = None
    overhead_bytes: int = RUNTIME_OVERHEAD_BYTES  # one process's runtime
    # mmap_weights=True: a mapped plan whose page cache is short is kept, and its
    # reread_warning() says what it costs, instead of refused
    mapped_forced: bool = False


@dataclass(frozen=True)
class Shortfall:
    """A refused plan: the footprint that did not fit, the memory it was planned against and
    the limits it was planned under; an advisor turns it into the ways out."""

    fp: ModelFootprint  # of a mapped plan whose page cache is short: its blocks in anonymous memory
    mem: MemoryInfo
    limits: PlanLimits
    need_len: int  # tokens one sequence must hold
    overhead_bytes: int  # the runtimes of all fp's processes
    why: str = ""  # a first line before the needs, or none
    page_cache: bool = False  # the blocks would be mapped, but the page cache is short

    @property
    def budget(self) -> int:
        """Bytes of mem the engine plans to use."""
        return int(self.mem.available_bytes * MEMORY_UTILIZATION)

    @property
    def activation_bytes(self) -> int:
        """A step's workspace before the KV cache's share."""
        return activation_bytes(self.fp, self.limits.max_num_batched_tokens,
                                self.limits.max_num_seqs, 0)

    def text(self) -> str:
        """why, what fp needs, and what is available."""
        fp, act = self.fp, self.activation_bytes
        one_seq = fp.kv_bytes_per_token * self.need_len
        need = fp.weight_bytes + one_seq + self.overhead_bytes + act
        return (f"{self.why}the model does not fit in memory{_where(fp)}: it needs "
                f"{fmt_bytes(need)} = weights {fmt_bytes(fp.weight_bytes)} "
                f"({fp.num_params / 1e9:.2f} B parameters in {fp.dtype_name}; {fp.source}) + "
                f"KV cache {fmt_bytes(one_seq)} for one sequence of {self.need_len} tokens + "
                f"activations {fmt_bytes(act)} + runtime {fmt_bytes(self.overhead_bytes)}\n"
                f"available: {fmt_bytes(self.mem.available_bytes)} ({self.mem.source}); the "
                f"engine plans with {MEMORY_UTILIZATION:.0%} of it = {fmt_bytes(self.budget)}")

    def error(self) -> InsufficientMemoryError:
        """The refusal without ways out (no advisor)."""
        return InsufficientMemoryError(self.text(), page_cache=self.page_cache, shortfall=self)


# turns a refusal into its error with the ways out (advice_text.advise)
Advisor = Callable[[Shortfall], InsufficientMemoryError]


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
    kv_used: bool = True  # False: an encoder, whose blocks count tokens and hold nothing

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
        kv = (f"KV cache {fmt_bytes(self.kv_cache_bytes)} ({self.num_blocks} blocks of "
              f"{self.block_size} = {self.num_blocks * self.block_size} tokens)" if self.kv_used
              else "no KV cache (an encoder attends within each step)")
        return (f"memory plan{where}: weights {fmt_bytes(self.weight_bytes)}{self.mapped_note()}, "
                f"{kv}, activations "
                f"{fmt_bytes(self.activation_bytes)}, runtime {fmt_bytes(self.overhead_bytes)}; "
                f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}; "
                "preemption recomputes (no swap space); "
                f"available {fmt_bytes(self.available.available_bytes)} ({self.available.source})")


def plan_memory(fp: ModelFootprint, mem: MemoryInfo, limits: PlanLimits,
                advisor: Optional[Advisor] = None) -> MemoryPlan:
    """Choose KV blocks and max_model_len that fit mem under limits; explicit values win if
    they fit, else explain (limits.mapped_forced: keep a mapped plan whose page cache is short,
    with its reread_warning()). advisor: adds the ways out to a refusal (without one it says
    only why; the advice plans its ways with this function)."""
    block_size, max_model_len, num_blocks = (limits.block_size, limits.max_model_len,
                                             limits.num_blocks)
    if max_model_len is not None and max_model_len > fp.max_len_supported:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model supports "
                         f"({fp.max_len_supported} positions)")
    # the length a default plan may shrink to: one sequence of this must fit
    short = Shortfall(fp, mem, limits, max_model_len or min(MIN_MODEL_LEN, fp.max_len_supported),
                      limits.overhead_bytes * fp.processes)

    def refusal(**changes) -> InsufficientMemoryError:
        got = replace(short, **changes)
        return advisor(got) if advisor is not None else got.error()

    load_peak = fp.weight_bytes + fp.load_extra_bytes + short.overhead_bytes
    # the load's peak is the reason only where the weights themselves would fit
    if (fp.load_extra_bytes and load_peak > short.budget
            and fp.weight_bytes + short.overhead_bytes <= short.budget):
        raise refusal(why=_load_why(fp, load_peak))
    if fp.arch.is_encoder:
        return _encoder_plan(fp, mem, limits, short, refusal)
    free_for_kv = _free_for_kv(short)
    want_len = max_model_len or fp.max_len_supported
    explicit_cache = num_blocks is not None or limits.kv_cache_bytes is not None
    if num_blocks is None:
        chosen = (limits.kv_cache_bytes if limits.kv_cache_bytes is not None
                  else _default_kv_bytes(short, free_for_kv, want_len))
        num_blocks = chosen // (fp.kv_bytes_per_token * block_size)
    cache_tokens = num_blocks * block_size
    min_len = max_model_len or (1 if explicit_cache else min(MIN_MODEL_LEN, want_len))
    kv_bytes = cache_tokens * fp.kv_bytes_per_token
    if kv_bytes > free_for_kv or (not explicit_cache and cache_tokens < min_len):
        raise refusal(need_len=min_len if not explicit_cache else max(1, cache_tokens))
    if cache_tokens < min_len:
        raise ValueError(f"max_model_len={min_len} does not fit the KV cache ({num_blocks} blocks "
                         f"of {block_size} = {cache_tokens} tokens); lower max_model_len or "
                         "raise kv_cache_memory_bytes")
    plan = MemoryPlan(num_blocks, block_size, min(want_len, cache_tokens), limits.max_num_seqs,
                      fp.weight_bytes, kv_bytes, activation_bytes(
                          fp, limits.max_num_batched_tokens, limits.max_num_seqs, kv_bytes),
                      short.overhead_bytes, mem, fp.mapped_bytes, fp.where)
    if plan.mapped_tight() and not limits.mapped_forced:
        anon = replace(fp, weight_bytes=fp.weight_bytes + fp.mapped_bytes, mapped_bytes=0)
        raise refusal(fp=anon, why=_tight_why(plan, fp), page_cache=True)
    return plan


def _encoder_plan(fp: ModelFootprint, mem: MemoryInfo, limits: PlanLimits, short: Shortfall,
                  refusal: Callable[..., InsufficientMemoryError]) -> MemoryPlan:
    """An encoder's plan: no KV cache (its attention sees the step's own tokens), so its blocks
    only count tokens for the scheduler, enough for max_num_seqs inputs of max_model_len and
    free of memory; the weights, activations and runtime must fit."""
    want_len = limits.max_model_len or fp.max_len_supported
    if fp.weight_bytes + short.overhead_bytes + short.activation_bytes > short.budget:
        raise refusal(need_len=want_len)
    num_blocks = limits.num_blocks or limits.max_num_seqs * -(-want_len // limits.block_size)
    return MemoryPlan(num_blocks, limits.block_size, want_len, limits.max_num_seqs,
                      fp.weight_bytes, 0, activation_bytes(
                          fp, limits.max_num_batched_tokens, limits.max_num_seqs, 0),
                      short.overhead_bytes, mem, fp.mapped_bytes, fp.where, kv_used=False)


def _free_for_kv(short: Shortfall) -> int:
    """Bytes the KV cache may take once the weights, runtimes and workspace are planned."""
    fp = short.fp
    # decode gathers one layer's context: 1/num_layers of the cache on top of the cache itself
    kv_share = 1 + fp.processes / max(1, fp.layers)
    rest = short.budget - fp.weight_bytes - short.overhead_bytes - short.activation_bytes
    return max(0, int(rest / kv_share))


def _default_kv_bytes(short: Shortfall, free_for_kv: int, want_len: int) -> int:
    """The KV cache a plan takes unless asked: what is free, capped at DEFAULT_KV_CAP_BYTES
    (never below one full-length sequence) and at max_num_seqs of them; with mapped weights,
    what leaves the page cache room for them first (never below one sequence of need_len)."""
    fp = short.fp
    one_seq = want_len * fp.kv_bytes_per_token
    default = min(free_for_kv, max(DEFAULT_KV_CAP_BYTES, one_seq),
                  one_seq * short.limits.max_num_seqs)
    if fp.mapped_bytes:
        least = short.need_len * fp.kv_bytes_per_token
        default = min(default, free_for_kv, max(least, free_for_kv - fp.mapped_bytes))
    return default


def _load_why(fp: ModelFootprint, load_peak: int) -> str:
    """Why a load of kept blocks in anonymous memory is refused: it holds them twice."""
    if fp.mapped_bytes or fp.layout is None or fp.layout.mapped_total:
        return (f"loading does not fit in memory{_where(fp)}: the GGUF's "
                f"{fmt_bytes(fp.load_extra_bytes)} of kept blocks are read, then regrouped "
                f"for the kernels, and the load peaks near {fmt_bytes(load_peak)} with the "
                f"runtime; mapped from a file (mmap_weights) they are regrouped into it instead\n")
    return (f"loading does not fit in memory{_where(fp)}: the {fmt_bytes(fp.load_extra_bytes)} "
            "of blocks quantized at load are made, then regrouped for the kernels, and the "
            f"load peaks near {fmt_bytes(load_peak)} with the runtime\n")


def _tight_why(plan: MemoryPlan, fp: ModelFootprint) -> str:
    """Why a mapped plan is refused: the page cache it plans holds too few of the blocks."""
    room, reread = plan.page_cache_room(), plan.reread_bytes_per_step()
    cost = (f"each decode step would re-read ~{fmt_bytes(reread)} from disk" if reread else
            "decoding may still find them all in the page cache")
    return (f"the GGUF's blocks do not fit in memory{_where(fp)}, and mapped from a "
            f"file (mmap_weights) the page cache could hold only ~{fmt_bytes(room)} of "
            f"their {fmt_bytes(fp.mapped_bytes)} ({room / fp.mapped_bytes:.0%}; "
            f"pagedllm maps them from {MAPPED_MIN_SHARE:.0%}): {cost}; "
            f"mmap_weights=True maps them anyway\n")


def plan_pipeline_memory(fp: ModelFootprint, world_size: int, mem: MemoryInfo,
                         limits: PlanLimits, rank_mems: Optional[Sequence[MemoryInfo]] = None,
                         tp_size: int = 1, partition: Optional[Sequence[int]] = None,
                         advisor: Optional[Advisor] = None) -> MemoryPlan:
    """plan_memory for world_size pipeline stages of tp_size tensor parallel ranks each. Ranks
    that share this machine's memory (rank_mems None) are planned as the sum of their shares
    against `mem`; ranks that each have their own memory (a cgroup or a machine each:
    rank_mems[r], r the global rank) each plan their own share (their stage's, over tp_size),
    and all then take the fewest KV blocks and the shortest max_model_len any rank fits (every
    rank holds the same block ids). partition: layers per stage (else VLLM_PP_LAYER_PARTITION's
    or the even split)."""
    if rank_mems is None:
        return plan_memory(shared_footprint(fp, world_size, tp_size), mem, limits, advisor)
    plans = []
    for r, rank_mem in enumerate(rank_mems):
        share = tp_share(stage_footprint(fp, PipelineStage.of_rank(
            fp.arch.num_hidden_layers, r // tp_size, world_size, partition)), tp_size)
        if tp_size > 1:  # the refusal names the rank, as its process's messages do
            share = replace(share, where=f"rank {r}, {share.where}")
        plans.append(plan_memory(share, rank_mem, limits, advisor))  # a refusal names the rank
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
