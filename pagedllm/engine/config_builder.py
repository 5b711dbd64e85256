"""EngineArgs + checkpoint metadata -> EngineConfig: platform, dtype and a memory plan, before loading."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pagedllm.config import (AT_LOAD_METHODS, CacheConfig, EngineConfig, ModelArchConfig,
                             ParallelConfig, SchedulerConfig)
from pagedllm.distributed.stage import PipelineStage
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.runner_choice import RunnerChoice, choose_runner
from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.loader.gguf.header import GGUFTensorInfo
from pagedllm.loader.metadata import checkpoint_num_params, gguf_kept_embedding, gguf_tensors
from pagedllm.memory.advice_text import advise
from pagedllm.memory.footprint import ModelFootprint, footprint, lora_bytes, regrouped_bytes
from pagedllm.memory.head_screen import screen_bytes, screen_planned
from pagedllm.memory.plan import (InsufficientMemoryError, MemoryPlan, PlanLimits, plan_memory,
                                  plan_pipeline_memory)
from pagedllm.memory.rank_memory import RankNodes, rank_memories
from pagedllm.memory.weight_formats import FormatCost, format_costs, format_of, format_summary
from pagedllm.memory.weight_layout import (gguf_weight_bytes, planned_weight_layout,
                                           quantized_at_load, weight_layout)
from pagedllm.platforms import Platform, resolve_dtype, resolve_platform
from pagedllm.platforms.gpu import TorchGpuPlatform
from pagedllm.platforms.interface import MemoryInfo, fmt_bytes

logger = logging.getLogger("pagedllm")

# where each rank of a cluster will run and the memory it has there, read on its node
# (pagedllm.executor.read_rank_nodes: Ray's), else None
RankNodeReader = Callable[[ParallelConfig], Optional[RankNodes]]


def _max_num_batched_tokens(args: EngineArgs, ckpt: Checkpoint, platform: Platform) -> int:
    """The token budget asked for, or the platform's default for this model and caller."""
    return args.max_num_batched_tokens or platform.default_max_num_batched_tokens(
        ckpt.arch.intermediate_size, args.usage_context == "api_server")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_quantization(args: EngineArgs, ckpt: Checkpoint, platform: Platform,
                         build_kernels: bool = True) -> str:
    """"gguf", "int8", "int8_g128", "int4", "bf16" or "none" for this checkpoint on this platform.

    By default a GGUF keeps its quantized blocks on the CPU (the kernels are CPU kernels); on
    other devices, or if the kernels cannot be built, it is dequantized to dtype at load. A
    bf16 checkpoint with dtype="auto" on the CPU keeps its matrices in bf16 for pagedllm's own
    kernels ("bf16": the same numbers as its weights in float32, half the memory of float32);
    an explicit dtype keeps vLLM's behaviour (quantization "none").
    build_kernels=False plans as if the kernels built (doctor: no compile for a report).
    """
    wanted = args.quantization
    on_cpu = platform.name == "cpu"
    is_gguf = ckpt.kind == "gguf"
    if wanted == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a .gguf checkpoint; for a float checkpoint "
                         f"use quantization={', '.join(map(repr, AT_LOAD_METHODS[:-1]))} or "
                         f"{AT_LOAD_METHODS[-1]!r}")
    if wanted in AT_LOAD_METHODS and is_gguf:
        raise ValueError(f"quantization={wanted!r} quantizes float checkpoints; this GGUF is "
                         "already quantized (leave quantization unset to keep its blocks)")
    if wanted is None and is_gguf and ckpt.arch.is_encoder:
        return "none"  # an encoder's layers have no block modules: dequantized at load
    if wanted is None and not is_gguf:
        wanted = "bf16" if _bf16_by_default(args, ckpt, platform) else "none"
        if wanted == "bf16" and build_kernels and not platform.load_kernels():
            return "none"  # the kernels log line says why
    if wanted == "none" or (wanted is None and not is_gguf):
        return "none"
    if not on_cpu:
        if wanted is not None:
            raise ValueError(f"quantization={wanted!r} runs on the CPU only (its kernels are CPU "
                             f"kernels); the device here is {platform.name}: use device='cpu' or "
                             "quantization='none'")
        return "none"
    if build_kernels and not platform.load_kernels():
        if wanted is not None:
            raise ValueError(f"quantization={wanted!r} needs pagedllm's CPU kernels, which "
                             f"could not be built: {platform.kernels_error}")
        return "none"  # make_engine_config says so, with the dtype and the cost
    return wanted or "gguf"


def _bf16_by_default(args: EngineArgs, ckpt: Checkpoint, platform: Platform) -> bool:
    """Whether a float checkpoint, quantization unset, keeps its matrices in bf16: a dense
    decoder stored in bf16 (its values are bf16 already: nothing is rounded), dtype="auto", on
    the CPU, where pagedllm's bf16 kernels (and the C++ decode step they allow) beat the
    alternative on every CPU measured (docs/performance.md):
    - without native bf16 the alternative is the float32 upcast (Zen 3 AVX2: 1.23-1.5x
      one-stream decode, ~1 GB less on the default model);
    - with AVX512-BF16 (Zen 4) or AMX-BF16 it is torch's bf16 matmuls in the layer loop: the
      vdpbf16ps blocks / amx tiles are 1.0-3x oneDNN's per matmul and 1.3-2x end to end.
    float16 and float32 checkpoints stay float (bf16 would round them), and so does every
    explicit dtype (vLLM's behaviour)."""
    if platform.name != "cpu":
        return False
    return (ckpt.arch.torch_dtype == "bfloat16"
            and ckpt.arch.moe is None and ckpt.arch.encoder is None
            and str(args.dtype or "auto").lower() == "auto")


def engine_dtype(requested: object, checkpoint_dtype: Optional[str], platform: Platform,
                 quantization: str) -> torch.dtype:
    """The dtype the engine computes in: the platform's choice for 'auto', else what was asked;
    float32 for a model whose matrices stay in GGML blocks.

    The block kernels take and return float32 activations, and the norms, biases, residual
    stream and KV cache of such a model stay in float32 too, so that the captured decode step
    (the whole layer stack in one C++ call) runs it and gives the same numbers as the layer loop.
    bfloat16 would save nothing on the weights and was 1.7-1.9x slower in decode on an
    AVX512-BF16 Zen 4 (README's performance section); an explicit bfloat16/float16 is refused
    rather than silently changed.
    """
    dtype = resolve_dtype(requested, checkpoint_dtype, platform)  # checks the name
    if quantization == "none":
        return dtype
    if str(requested or "auto").lower() != "auto" and dtype != torch.float32:
        name = _dtype_name(dtype)
        raise ValueError(f"dtype={name!r} with quantization={quantization!r}: the CPU block "
                         "kernels compute in float32 (norms and biases too); pass "
                         "dtype='auto' or 'float32', or quantization='none' to run dequantized "
                         f"{name} weights")
    return torch.float32


def kv_cache_torch_dtype(requested: str, dtype: torch.dtype, platform: Platform,
                         quantization: str = "none") -> torch.dtype:
    """The KV cache's dtype for kv_cache_dtype `requested` under compute dtype `dtype`: "auto"
    keeps the cache in it, except under bf16 weights on the CPU (quantization "bf16": a bf16
    checkpoint's matrices kept for pagedllm's kernels, float32 compute), where it is bf16, as
    vLLM's "auto" (the model's dtype) and transformers in bf16 keep it; that dtype's name keeps
    it there ("float32": the float32 cache). "bfloat16" under float32 compute on the CPU halves
    the cache (its C++ ops widen bf16 rows exactly; the rows are rounded once, as they are
    written). Another is a ValueError naming both and what to use."""
    name = _dtype_name(dtype)
    cpu_bf16 = platform.name == "cpu" and dtype == torch.float32
    if requested == "auto" and cpu_bf16 and quantization == "bf16":
        return torch.bfloat16
    if requested in ("auto", name):
        return dtype
    if requested == "bfloat16" and cpu_bf16:
        return torch.bfloat16
    fp8 = " (fp8 KV caches are not implemented)" if requested.startswith("fp8") else ""
    also = " or 'bfloat16'" if cpu_bf16 else ""
    raise ValueError(f"kv_cache_dtype={requested!r}: pagedllm keeps the KV cache in the dtype "
                     f"the model computes in, {name} here{fp8}; use kv_cache_dtype='auto' (or "
                     f"{name!r}){also}, or choose the compute dtype with dtype=")


def _keeps_gguf_blocks(ckpt: Checkpoint, platform: Platform, quantization: str,
                       tensors: Optional[Sequence[GGUFTensorInfo]]) -> bool:
    """Whether a GGUF keeps some of its blocks (model_loader's plan): every matrix of the
    kernels' types, or run dequantized, the token embedding's (gguf_kept_embedding)."""
    if ckpt.kind != "gguf" or quantization not in ("gguf", "none"):
        return False
    return quantization == "gguf" or gguf_kept_embedding(
        ckpt, platform.block_types(), tensors) is not None


def _rank_weight_bytes(args: EngineArgs, ckpt: Checkpoint, platform: Platform,
                       dtype: torch.dtype, quantization: str) -> list[int]:
    """Each rank's weights (its stage's, over its stage's TP ranks), in global rank order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    kept = platform.block_types() if ckpt.kind == "gguf" else frozenset()
    layout = planned_weight_layout(ckpt, kept, quantization, itemsize)
    layers = ckpt.arch.num_hidden_layers
    pp, tp = args.pipeline_parallel_size, args.tensor_parallel_size
    out = []
    for r in range(pp):
        stage = PipelineStage.of_rank(layers, r, pp)
        size, _ = layout.stage_bytes(stage.start_layer, stage.end_layer, stage.is_first,
                                     stage.is_last)
        out += [size // tp] * tp
    return out


def ray_rank_nodes(args: EngineArgs, ckpt: Checkpoint, platform: Platform, dtype: torch.dtype,
                   quantization: str, read_nodes: Optional[RankNodeReader]) -> Optional[RankNodes]:
    """With pipeline stages as Ray actors on a cluster, the node each rank will run on and
    the memory it has there (read on its node by read_nodes; the largest stage on the most
    memory), else None."""
    parallel = args.parallel_config()
    if (read_nodes is None or parallel.backend != "ray" or parallel.pipeline_parallel_size == 1
            or platform.name != "cpu"):
        return None
    nodes = read_nodes(parallel)
    if nodes is None:
        return None
    return nodes.fit(_rank_weight_bytes(args, ckpt, platform, dtype, quantization))


def plan_engine_memory(args: EngineArgs, ckpt: Checkpoint, platform: Platform,
                       dtype: torch.dtype, quantization: Optional[str] = None,
                       rank_mems: Optional[Sequence[MemoryInfo]] = None,
                       draft: Optional[ModelFootprint] = None
                       ) -> tuple[MemoryPlan, torch.dtype]:
    """Size the KV cache and max_model_len from metadata, trying _candidates' plans in turn
    (a GGUF's blocks mapped, or with dtype 'auto' a half-size dtype, when the first does not fit).

    With pipeline_parallel_size N, each rank's share is planned (its layers' weights, KV cache
    and workspace, and a runtime): ranks that share this machine's memory for their sum, ranks
    that each run in their own cgroup (PAGEDLLM_RANK_CGROUP) each against that cgroup's limit,
    which the rank checks again where it runs before it loads anything; rank_mems, when
    given, is each rank's memory read where it will run (Ray nodes: ray_rank_nodes). With
    tensor_parallel_size M too, a rank's share is its stage's over M (memory/footprint.py's
    tp_share). draft: a draft model's footprint (plan_draft), held beside the model: its
    weights, and its KV cache with as many blocks."""
    if quantization is None:
        quantization = resolve_quantization(args, ckpt, platform, build_kernels=False)
    planner = CandidatePlanner.of(args, ckpt, platform, quantization, rank_mems, draft)
    candidates = _candidates(args, ckpt, platform, dtype, quantization, planner.mem)
    result, chosen = _first_that_fits(candidates, planner.plan)
    if chosen.forced:
        _warn_mapped_tight(result)
    return result, chosen.dtype


def _warn_mapped_tight(result: MemoryPlan) -> None:
    """mmap_weights=True kept a mapped plan: warn for each share whose page cache is short."""
    for share in result.ranks or (result,):
        if share.mapped_tight():
            logger.warning("%s", share.reread_warning())


def _rank_cgroup_memories(args: EngineArgs, platform: Platform
                          ) -> Optional[list[MemoryInfo]]:
    """With pipeline parallelism on the CPU, each rank's cgroup (every TP rank of every
    stage; rank_memories), else None."""
    pp = args.pipeline_parallel_size
    if pp > 1 and platform.name == "cpu":
        return rank_memories(pp * args.tensor_parallel_size)
    return None


@dataclass(frozen=True)
class CandidatePlanner:
    """What every candidate plan of one engine shares (the GGUF's tensor table, read once and
    handed down; the parameter count; the memory), and the plan of one Candidate."""

    args: EngineArgs
    ckpt: Checkpoint
    platform: Platform
    quantization: str
    tensors: Optional[Sequence[GGUFTensorInfo]]
    num_params: int
    params_source: str
    mem: MemoryInfo
    rank_mems: Optional[Sequence[MemoryInfo]]
    batched: int  # max_num_batched_tokens
    keeps_blocks: bool  # a GGUF keeping some of its blocks (_keeps_gguf_blocks)
    draft: Optional[ModelFootprint] = None  # a draft model's, held beside this model's
    head_screen: bool = False  # the greedy head's int8 screen sits beside the weights

    @classmethod
    def of(cls, args: EngineArgs, ckpt: Checkpoint, platform: Platform, quantization: str,
           rank_mems: Optional[Sequence[MemoryInfo]],
           draft: Optional[ModelFootprint] = None, screens: bool = True) -> "CandidatePlanner":
        """Read the checkpoint's metadata and the memory once; rank_mems None: each rank's
        cgroup with pipeline parallelism (_rank_cgroup_memories); screens: whether this model
        may get a head screen (not a draft model: its runner has none)."""
        tensors = gguf_tensors(ckpt)
        num_params, source = checkpoint_num_params(ckpt, tensors)
        mem = platform.memory()
        if rank_mems is None:
            rank_mems = _rank_cgroup_memories(args, platform)
        screen = screens and head_screen_planned(args, ckpt, platform, quantization)
        return cls(args, ckpt, platform, quantization, tensors, num_params, source, mem,
                   rank_mems, _max_num_batched_tokens(args, ckpt, platform),
                   _keeps_gguf_blocks(ckpt, platform, quantization, tensors), draft, screen)

    def footprint(self, c: Candidate) -> ModelFootprint:
        """The model's footprint in this candidate's dtype, with the bytes its weights hold:
        a GGUF's kept blocks (mapped, when c.mapped), or blocks quantized at load."""
        ckpt, quantization = self.ckpt, self.quantization
        itemsize = torch.empty((), dtype=c.dtype).element_size()
        kept = self.platform.block_types() if ckpt.kind == "gguf" else frozenset()
        layout = planned_weight_layout(ckpt, kept, quantization, itemsize, self.tensors)
        # a GGUF keeping blocks holds the layout's bytes (its kept ones mapped, when asked)
        weights = layout.total if self.keeps_blocks else None
        name = _dtype_name(c.dtype) + (" with GGUF blocks kept" if self.keeps_blocks else "")
        at_load = quantized_at_load(ckpt, quantization)
        if at_load:  # the blocks made slice by slice as the float tensors are read
            weights, name = layout.total, f"{_dtype_name(c.dtype)} with {quantization} blocks"
        kv = kv_cache_torch_dtype(self.args.kv_cache_dtype, c.dtype, self.platform, quantization)
        fp = footprint(ckpt.arch, self.num_params, itemsize, name, self.params_source, weights,
                       layout.mapped_total if c.mapped else 0, layout,
                       kv_itemsize=torch.empty((), dtype=kv).element_size())
        lora = self.args.lora_config()
        if lora is not None:  # the adapters' slots and cache sit beside the weights
            extra = lora_bytes(ckpt.arch, lora, self.args.tensor_parallel_size)
            described = (f"{fp.dtype_name} + LoRA {lora.max_loras} slots and {lora.cpu_loras} "
                         f"read adapters of rank {lora.max_lora_rank} ({fmt_bytes(extra)})")
            fp = dataclasses.replace(fp, weight_bytes=fp.weight_bytes + extra, lora_bytes=extra,
                                     dtype_name=described)
        if self.head_screen:
            extra = screen_bytes(ckpt.arch)
            fp = dataclasses.replace(fp, weight_bytes=fp.weight_bytes + extra,
                                     dtype_name=f"{fp.dtype_name} + the greedy head's int8 "
                                                f"screen ({fmt_bytes(extra)})")
        if not c.mapped and (ckpt.kind == "gguf" or at_load):  # regrouping holds the blocks twice
            fp = dataclasses.replace(fp, load_extra_bytes=regrouped_bytes(
                layout, at_load, one_matrix=quantization == "bf16"))
        return fp if self.draft is None else with_draft(fp, self.draft)

    def plan(self, c: Candidate) -> MemoryPlan:
        """This candidate's plan, or its InsufficientMemoryError: one rank's, or each
        pipeline rank's share with pipeline parallelism."""
        args, fp = self.args, self.footprint(c)
        limits = PlanLimits(args.block_size, args.max_num_seqs, self.batched, args.max_model_len,
                            args.kv_cache_memory_bytes, args.num_gpu_blocks_override,
                            mapped_forced=c.forced)
        if args.pipeline_parallel_size > 1:
            return plan_pipeline_memory(fp, args.pipeline_parallel_size, self.mem, limits,
                                        self.rank_mems, args.tensor_parallel_size,
                                        advisor=advise)
        return plan_memory(fp, self.mem, limits, advise)


@dataclass(frozen=True)
class Candidate:
    """One plan to try: the dtype, whether the GGUF's kept blocks are mapped from a file
    (forced: mmap_weights=True), the warning logged when it is chosen after the ones before it
    were refused, and a note its own refusal adds."""

    dtype: torch.dtype
    mapped: bool = False
    forced: bool = False
    chosen_warning: str = ""
    refusal_note: str = ""

    def refusal(self, first: InsufficientMemoryError,
                own: InsufficientMemoryError) -> InsufficientMemoryError:
        """The error to raise when every plan up to this one was refused: a mapped plan whose
        page cache would be short says so (its advice is the same), else the first refusal
        stands; a note is added where one is given."""
        if self.mapped and not self.forced:
            return own if own.page_cache else first
        return own.with_note(self.refusal_note) if self.refusal_note else own


def _candidates(args: EngineArgs, ckpt: Checkpoint, platform: Platform, dtype: torch.dtype,
                quantization: str, mem: MemoryInfo) -> list[Candidate]:
    """The plans to try, in turn: the dtype asked for with the weights in anonymous memory;
    then, for a GGUF whose blocks are kept on the CPU (mmap_weights unset), its blocks mapped;
    or, with dtype 'auto' and float32 weights, a half-size dtype. mmap_weights=True: only the
    mapped plan, kept even where the page cache is short."""
    can_map = quantization == "gguf" and ckpt.kind == "gguf" and platform.name == "cpu"
    if args.mmap_weights and not can_map:
        raise ValueError("mmap_weights=True maps a GGUF's kept blocks on the CPU; this engine "
                         f"runs a {ckpt.kind} checkpoint with quantization {quantization!r} on "
                         f"the {platform.name}")
    if args.mmap_weights:
        return [Candidate(dtype, mapped=True, forced=True)]
    out = [Candidate(dtype)]
    if can_map and args.mmap_weights is None:
        out.append(Candidate(dtype, mapped=True, chosen_warning=(
            "the GGUF's blocks do not fit in memory beside the runtime and the KV cache: they "
            "are mapped, regrouped, from a cache file instead (mmap_weights), so the page "
            "cache holds them")))
        return out
    half = torch.bfloat16 if torch.bfloat16 in platform.supported_dtypes() else None
    kept_blocks = quantization != "none"  # computed in float32: no half-size fallback
    if str(args.dtype) == "auto" and dtype == torch.float32 and half and not kept_blocks:
        out.append(Candidate(half, chosen_warning=(
            f"float32 weights do not fit in {fmt_bytes(mem.available_bytes)}; "
            f"using {_dtype_name(half)} (dtype='auto')"),
            refusal_note="  (float32, this device's default, needs twice the weights)"))
    return out


def _first_that_fits(candidates: Sequence[Candidate], plan: Callable[[Candidate], MemoryPlan]
                     ) -> tuple[MemoryPlan, Candidate]:
    """The first candidate's plan that fits, and that candidate; when none does, the
    refusal the last one names (Candidate.refusal)."""
    first: Optional[InsufficientMemoryError] = None
    for candidate in candidates:
        try:
            result = plan(candidate)
        except InsufficientMemoryError as err:
            first = first or err
            refusal = candidate.refusal(first, err)
            continue
        if candidate.chosen_warning:
            logger.warning("%s", candidate.chosen_warning)
        return result, candidate
    raise refusal


def _dequantized_note(ckpt: Checkpoint, platform: Platform, dtype: torch.dtype,
                      weight_bytes: int) -> str:
    """The one line that says a GGUF runs dequantized because the kernels did not build: why,
    in which dtype, and the weights' resident size against their size in GGUF blocks."""
    kept = gguf_weight_bytes(ckpt, platform.block_types(), 4)  # kept blocks compute in float32
    return (f"pagedllm's CPU kernels could not be built: {platform.kernels_error}. The GGUF is "
            f"dequantized to {_dtype_name(dtype)} at load: weights {fmt_bytes(weight_bytes)} "
            f"instead of {fmt_bytes(kept)} in GGUF blocks, and decode is slower")


def _dtype_reason(args: EngineArgs, ckpt: Checkpoint, platform: Platform, quantization: str,
                  dtype: torch.dtype, halved: bool) -> str:
    """Why the engine computes in `dtype` (one log line)."""
    if quantization != "none":
        return (f"quantization {quantization}: pagedllm's CPU block kernels compute in float32 "
                "(norms and biases too)")
    if halved:
        return "float32 weights do not fit in memory (dtype='auto')"
    if str(args.dtype).lower() != "auto":
        return f"dtype={str(args.dtype).removeprefix('torch.')!r} was asked for"
    why = (f"dtype='auto': the {platform.name} default for a "
           f"{ckpt.arch.torch_dtype or 'float'} checkpoint")
    if platform.name == "cpu" and dtype == torch.bfloat16:
        why += "; this CPU computes bf16 natively"
    elif platform.name == "cpu" and not platform.info.native_bf16:
        why += "; this CPU has no native bf16, so float32 is faster"
    return why


def weight_format_costs(ckpt: Checkpoint) -> dict[str, FormatCost]:
    """What fp32, bf16, int8 and int4 weights of a float checkpoint cost and give on the CPU
    (memory/weight_formats.py), from its tensor table; doctor reports them."""
    return format_costs(ckpt.arch, weight_layout(ckpt, 1))


def _pooling_args(args: EngineArgs, runner: RunnerChoice, arch: ModelArchConfig) -> EngineArgs:
    """A pooling runner's inputs no longer than its files allow (vLLM's max_model_len for a
    sentence-transformers model), with no prefix cache (an encoder's keys depend on the
    tokens after them), and a classification head's weights as stored."""
    if runner.runner != "pooling":
        return args
    max_len = args.max_model_len
    if max_len is None and runner.max_seq_length is not None:
        max_len = runner.max_seq_length
    # a classification head reads plain weights (runner_choice refuses the other formats)
    quantization = "none" if arch.classifier is not None else args.quantization
    return dataclasses.replace(args, max_model_len=max_len, enable_prefix_caching=False,
                               quantization=quantization)


def make_engine_config(args: EngineArgs, ckpt: Checkpoint,
                       read_nodes: Optional[RankNodeReader] = None,
                       draft_ckpt: Optional[Checkpoint] = None) -> EngineConfig:
    """Resolve the runner, the platform and dtype, and plan memory, for a checkpoint;
    read_nodes: where a cluster's ranks will run, and their memory there (the engine passes
    the executors' pagedllm.executor.read_rank_nodes; None plans on this machine);
    draft_ckpt: speculative_config's draft model (method "draft_model"), planned beside it."""
    runner = choose_runner(args, ckpt)
    args = _pooling_args(args, runner, ckpt.arch)
    choice = resolve_platform(args.device)
    if args.gpu_memory_utilization is not None:
        if isinstance(choice.platform, TorchGpuPlatform):
            choice.platform.utilization = args.gpu_memory_utilization
        else:
            logger.warning("gpu_memory_utilization=%s has no effect on the %s: memory is planned "
                           "from what the OS and cgroup allow", args.gpu_memory_utilization,
                           choice.platform.name)
    quantization = resolve_quantization(args, ckpt, choice.platform)
    dtype = engine_dtype(args.dtype, ckpt.arch.torch_dtype, choice.platform, quantization)
    nodes = ray_rank_nodes(args, ckpt, choice.platform, dtype, quantization, read_nodes)
    draft = None if draft_ckpt is None else plan_draft(args, draft_ckpt, choice.platform)
    mem_plan, planned = plan_engine_memory(args, ckpt, choice.platform, dtype, quantization,
                                           None if nodes is None else nodes.memories,
                                           None if draft is None else draft.footprint)
    fell_back = args.quantization is None and ckpt.kind == "gguf" and quantization == "none"
    if fell_back and choice.platform.kernels_error is not None:  # not on a GPU: kernels failed
        logger.warning("%s", _dequantized_note(ckpt, choice.platform, planned,
                                               mem_plan.weight_bytes))
    logger.info("dtype %s: %s", _dtype_name(planned), _dtype_reason(
        args, ckpt, choice.platform, quantization, planned, planned != dtype))
    logger.info("%s", mem_plan.summary())
    lora = args.lora_config()
    if lora is not None:
        logger.info("LoRA adapters: %d slots and %d read adapters of rank %d at most, %s of the "
                    "planned weights", lora.max_loras, lora.cpu_loras, lora.max_lora_rank,
                    fmt_bytes(lora_bytes(ckpt.arch, lora, args.tensor_parallel_size)))
    chosen = format_of(_dtype_name(planned), quantization)
    if ckpt.kind != "gguf" and choice.platform.name == "cpu" and chosen is not None:
        logger.info("%s", format_summary(weight_format_costs(ckpt), chosen))
    dtype = planned
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype, choice.platform, quantization)
    if kv_dtype != dtype:
        why = ("auto with bf16 weights, as vLLM's auto and transformers in bf16; "
               "kv_cache_dtype='float32' keeps a float32 cache"
               if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
        logger.info("KV cache in %s (kv_cache_dtype %s): keys and values rounded to it as they "
                    "are written, half the cache's bytes", _dtype_name(kv_dtype), why)
    batched = _max_num_batched_tokens(args, ckpt, choice.platform)
    chunked_pooling = runner.runner == "pooling" and not ckpt.arch.is_encoder
    if runner.runner == "pooling" and not chunked_pooling:
        batched = max(batched, mem_plan.max_model_len)  # an encoder reads a whole input a step
    config = EngineConfig(
        model_path=str(ckpt.path), arch=ckpt.arch, dtype=dtype, platform=choice.platform,
        cache=CacheConfig(block_size=args.block_size, num_blocks=mem_plan.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching,
                          dtype=None if kv_dtype == dtype else kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=batched,
                                  max_model_len=mem_plan.max_model_len,
                                  chunked_pooling=chunked_pooling,
                                  max_loras=None if lora is None else lora.max_loras),
        parallel=args.parallel_config(), seed=args.seed, max_logprobs=args.max_logprobs,
        structured_outputs=args.structured_outputs_config(),
        quantization=quantization, mmap_weights=mem_plan.mapped_bytes > 0,
        rank_nodes=() if nodes is None else nodes.node_ids,
        step_timeout=args.step_timeout, runner=runner.runner, pooler=runner.pooler,
        hf_overrides=args.hf_overrides, lora=lora,
        speculative=args.speculative(),
        head_screen=head_screen_planned(args, ckpt, choice.platform, quantization))
    if draft is None:
        return config
    logger.info("draft model %s: %s, %s of weights, a KV cache of %d blocks beside the "
                "model's", draft_ckpt.path, draft.footprint.dtype_name,
                fmt_bytes(draft.footprint.weight_bytes), mem_plan.num_blocks)
    return dataclasses.replace(config, draft=draft.engine_config(config))


@dataclass(frozen=True)
class DraftPlan:
    """speculative_config's draft model as planned: its checkpoint, dtype, quantization and
    footprint (its weights and KV bytes per token, added to the target's)."""

    ckpt: Checkpoint
    dtype: torch.dtype
    quantization: str
    footprint: ModelFootprint

    def engine_config(self, target: EngineConfig) -> EngineConfig:
        """The draft's own config: its model, on the target's platform, with the target's
        cache blocks and scheduler limits; no LoRA, no speculation, not timed on its own."""
        return EngineConfig(model_path=str(self.ckpt.path), arch=self.ckpt.arch,
                            dtype=self.dtype, platform=target.platform, cache=target.cache,
                            scheduler=target.scheduler, seed=target.seed,
                            quantization=self.quantization, step_timeout=None)


def head_screen_planned(args: EngineArgs, ckpt: Checkpoint, platform: Platform,
                        quantization: str) -> bool:
    """Whether this model's greedy rows get the head's int8 screen (layers/head_screen.py)."""
    return screen_planned(ckpt.arch, quantization, platform.name == "cpu",
                          choose_runner(args, ckpt).runner, args.parallel_config().world_size)


def plan_draft(args: EngineArgs, ckpt: Checkpoint, platform: Platform) -> DraftPlan:
    """The draft model of args' speculative_config (method "draft_model") resolved as any
    model is (its own quantization and dtype), refused by name if it cannot draft."""
    spec = args.speculative()
    assert spec is not None and spec.model is not None
    draft_args = dataclasses.replace(
        args, model=spec.model, revision=spec.revision, quantization=spec.quantization,
        dtype=spec.dtype, speculative_config=None, enable_lora=False, hf_overrides=None,
        mmap_weights=None, tokenizer=None, gguf_file=None, runner="auto", task=None)
    runner = choose_runner(draft_args, ckpt)
    if runner.runner != "generate" or ckpt.arch.is_encoder:
        raise ValueError(f"speculative_config.model {spec.model!r} cannot draft: it is a "
                         f"{'encoder' if ckpt.arch.is_encoder else runner.runner} model, not "
                         "one that generates")
    quantization = resolve_quantization(draft_args, ckpt, platform)
    dtype = engine_dtype(spec.dtype, ckpt.arch.torch_dtype, platform, quantization)
    # the draft's cache is in its compute dtype (draft_runner.initialize_kv_cache)
    draft_args = dataclasses.replace(draft_args, kv_cache_dtype=_dtype_name(dtype))
    planner = CandidatePlanner.of(draft_args, ckpt, platform, quantization, None, screens=False)
    fp = planner.footprint(Candidate(dtype))
    return DraftPlan(ckpt, dtype, quantization, dataclasses.replace(
        fp, dtype_name=f"{_dtype_name(dtype)}, quantization {quantization}"))


def with_draft(fp: ModelFootprint, draft: ModelFootprint) -> ModelFootprint:
    """A model's footprint with a draft model's beside it: both weights, KV bytes per token
    of both (one block holds both models' keys and values); loads one after the other."""
    return dataclasses.replace(
        fp, weight_bytes=fp.weight_bytes + draft.weight_bytes,
        kv_bytes_per_token=fp.kv_bytes_per_token + draft.kv_bytes_per_token,
        load_extra_bytes=max(fp.load_extra_bytes, draft.load_extra_bytes),
        dtype_name=f"{fp.dtype_name} + draft model ({draft.dtype_name}, "
                   f"{fmt_bytes(draft.weight_bytes)})")


