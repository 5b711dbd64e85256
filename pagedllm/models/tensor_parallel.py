"""A tensor-parallel rank's share of a model, in two passes around the loading (gpt-fast's way:
modules swapped, the model code unchanged).

1. shard_model, on the meta device before any weight is allocated: each attention block keeps
   its rank's heads (q/k/v rows; KV heads replicated when fewer than ranks, as vLLM does) and
   the matching o_proj columns; each MLP its range of the intermediate rows (gate/up) and
   down_proj columns; the embedding and the head their vocabulary range. It returns, per
   checkpoint tensor, the part this rank loads (pagedllm/shard.py's Shard), so that
   the loaders read that part only.
2. add_collectives, once the weights are loaded (and packed or quantized): the all-reduce
   after attention and after the MLP, the embedding's all-reduce and the logits' all-gather
   (layers/tensor_parallel.py).

What each module is comes from the model's declared plan (`tp_plan` on the model class: module
path patterns -> "vocab", "attention", "feed_forward" or "replicated"), not from its class: a
module holding weights that no pattern covers is refused by name rather than left whole, and
a module whose class does not fit its role too.

A sparse MoE block (layers/moe.py) is split as vLLM splits it without expert parallelism:
every rank holds every expert, each expert (and the shared expert) an MLP split like the
others, the router and the shared expert's gate replicated. Every rank routes the same tokens
the same way (its input is the all-reduced residual stream), sums its experts' partial
down_proj outputs with the shared expert's, and one all-reduce after the whole block adds the
ranks' sums (not one per expert).

The heads split evenly; so do the MLPs' intermediate rows unless a kept down_proj's GGUF
blocks would be cut, when the rows split at block boundaries instead, unevenly (mlp_split).
A split that cannot be made (heads by ranks; o_proj's heads cutting its blocks; fewer
blocks than ranks) is a ValueError naming the tensor and the sizes. On a pipeline stage
(models/pipeline.py's keep_stage, which runs first) only the modules the stage holds are split:
the other stages' placeholders stay as they are. The tensors' summation order changes:
each rank sums its part of o_proj's and down_proj's reduction, then the all-reduce adds them.
"""
from __future__ import annotations

import fnmatch
import logging
import math
from typing import Iterator, NamedTuple, Optional

import torch
from torch import nn

from pagedllm.distributed.tensor_parallel import Shard, TensorParallelRank
from pagedllm.kernels.types import Q8_0G4, block_sizes
from pagedllm.layers.linear import MergedLinear
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.layers.quantization import Q8_0, QuantPlan
from pagedllm.layers.tensor_parallel import GatheredLogits, ReducedOutput, VocabParallelEmbedding
from pagedllm.models.llama import SelfAttention
from pagedllm.models.pipeline import holds_module

Shards = dict[str, Shard]  # checkpoint tensor name -> this rank's part of it

logger = logging.getLogger("pagedllm")


def _rows(part: range, full: int) -> Shard:
    """Output rows `part` of `full` (column-parallel)."""
    return Shard(0, part.start, len(part), full)


def _check_blocks(path: str, part: range, plan: Optional[QuantPlan], tp: TensorParallelRank
                  ) -> None:
    """o_proj (row-parallel, split by whole heads) kept in GGUF blocks must split its rows at
    whole blocks (head_dim 64 or 128 with 32-value blocks does; 256-value K-quants may not)."""
    qtype = (plan or {}).get(path)
    if qtype is None:
        return
    block = block_sizes(qtype)[0]
    if part.start % block or len(part) % block:
        instead = ("quantization='int8' (a scale per 32 values)" if qtype == Q8_0G4 else
                   "load it dequantized with quantization='none'")
        raise ValueError(
            f"tensor_parallel_size={tp.world_size}: {path}.weight is kept in {qtype.name} "
            f"blocks of {block} values, and its rows of {len(part) * tp.world_size} values "
            f"split into {len(part)} per rank, not whole blocks ({instead}, or use "
            f"pipeline_parallel_size)")


def _fit_groups(path: str, part: range, plan: Optional[QuantPlan]) -> None:
    """An o_proj made at load in groups of 128 values (int8_g128's Q8_0G4) whose rank part would
    cut a group keeps Q8_0 in the plan instead (the same int8 blocks, a scale per 32 values), as
    a row of no multiple of 128 values does (layers/quantization.py). Every rank cuts at the
    same places (the heads split evenly), so every rank makes the same choice."""
    group = block_sizes(Q8_0G4)[0]
    if plan is not None and plan.get(path) == Q8_0G4 and (part.start % group or len(part) % group):
        plan[path] = Q8_0


def _merged(old: MergedLinear, sizes: tuple[int, ...]) -> MergedLinear:
    return MergedLinear(old.in_features, sizes, old.shard_names, bias=old.bias is not None)


def _shard_attention(path: str, attn: SelfAttention, tp: TensorParallelRank,
                     plan: Optional[QuantPlan]) -> Shards:
    d = attn.head_dim
    heads = tp.split(attn.num_heads, f"{path}.q_proj", "attention heads")
    kv = tp.kv_heads(attn.num_kv_heads, f"{path}.k_proj")
    q_rows = range(heads.start * d, heads.stop * d)
    kv_rows = range(kv.start * d, kv.stop * d)
    _fit_groups(f"{path}.o_proj", q_rows, plan)
    _check_blocks(f"{path}.o_proj", q_rows, plan, tp)
    old = attn.qkv_proj
    attn.qkv_proj = _merged(old, (len(q_rows), len(kv_rows), len(kv_rows)))
    hidden = attn.o_proj.out_features
    attn.o_proj = nn.Linear(len(q_rows), hidden, bias=attn.o_proj.bias is not None)
    attn.num_heads, attn.num_kv_heads = len(heads), len(kv)
    attn.attn.num_heads, attn.attn.num_kv_heads = len(heads), len(kv)  # shown by its repr
    q_full, kv_full = old.output_sizes[0], old.output_sizes[1]
    shards = {f"{path}.o_proj.weight": Shard(1, q_rows.start, len(q_rows), q_full)}
    for name, rows, full in (("q_proj", q_rows, q_full), ("k_proj", kv_rows, kv_full),
                             ("v_proj", kv_rows, kv_full)):
        kinds = ("weight", "bias") if old.bias is not None else ("weight",)
        shards.update({f"{path}.{name}.{kind}": _rows(rows, full) for kind in kinds})
    return shards


class MlpSplit(NamedTuple):
    """Where the MLPs' intermediate rows may be cut: at multiples of `block` (the least common
    multiple of the block sizes of every kept down_proj; 1 when none is kept), and the kept
    types, for messages."""

    block: int
    types: tuple[str, ...]


def mlp_split(plan: Optional[QuantPlan]) -> MlpSplit:
    """The model-wide unit of the MLPs' split (one split for every layer: the ranks' shares,
    and the memory they plan, are the same in each)."""
    # every down_proj: the layers' MLPs, and a MoE block's experts and shared expert
    kept = {q for path, q in (plan or {}).items() if path.endswith(".down_proj")}
    types = tuple(sorted(q.name for q in kept))
    return MlpSplit(math.lcm(*(block_sizes(q)[0] for q in kept)) if kept else 1, types)


def mlp_rows(path: str, full: int, split: MlpSplit, tp: TensorParallelRank) -> range:
    """This rank's intermediate rows of the MLP at `path`: the even split when no down_proj
    keeps blocks (as before), else cut at block boundaries (uneven when the even split would
    cut a block: gate/up take whole rows, down_proj whole blocks of every row, so the numbers
    stay the file's)."""
    if split.block == 1:
        return tp.split(full, f"{path}.gate_proj", "intermediate rows")
    return tp.split_blocks(full, split.block, f"{path}.down_proj.weight, kept in "
                           f"{'/'.join(split.types)} blocks,", "values a row")


def _shard_mlp(path: str, mlp: GatedMLP, tp: TensorParallelRank, split: MlpSplit) -> Shards:
    full = mlp.down_proj.in_features
    rows = mlp_rows(path, full, split, tp)
    mlp.gate_up_proj = _merged(mlp.gate_up_proj, (len(rows), len(rows)))
    hidden = mlp.down_proj.out_features
    mlp.down_proj = nn.Linear(len(rows), hidden, bias=mlp.down_proj.bias is not None)
    return {f"{path}.gate_proj.weight": _rows(rows, full),
            f"{path}.up_proj.weight": _rows(rows, full),
            f"{path}.down_proj.weight": Shard(1, rows.start, len(rows), full)}


def _shard_vocab(model: nn.Module, tp: TensorParallelRank) -> Shards:
    """The embedding and the head, where this rank's pipeline stage holds them: this rank's
    vocabulary rows (the same rows, so a tied head still shares the embedding's)."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    rows = tp.split(vocab, "model.embed_tokens.weight", "vocabulary rows")
    n = len(rows)
    shards = {}
    if holds_module(model.model.embed_tokens):
        model.model.embed_tokens = nn.Embedding(n, hidden, _weight=torch.empty(n, hidden))
        shards["model.embed_tokens.weight"] = Shard(0, rows.start, n, vocab)
    if holds_module(model.lm_head):
        model.lm_head = nn.Linear(hidden, n, bias=False)
        shards["lm_head.weight"] = Shard(0, rows.start, n, vocab)
    return shards


ROLES = ("vocab", "attention", "feed_forward", "replicated")


def _role(model: nn.Module, path: str) -> Optional[str]:
    """The role the model's tp_plan gives the module at `path`, if a pattern matches it."""
    for pattern, role in model.tp_plan.items():
        if fnmatch.fnmatchcase(path, pattern):
            if role not in ROLES:
                raise ValueError(f"{type(model).__name__}.tp_plan gives {pattern!r} the role "
                                 f"{role!r}; the roles are {', '.join(ROLES)}")
            return role
    return None


def planned_modules(model: nn.Module, tp: TensorParallelRank
                    ) -> Iterator[tuple[str, str, nn.Module]]:
    """(path, role, module) for every module the plan names that this stage holds, in module
    order; a ValueError for a module holding weights outside every planned one, or whose class
    does not fit its role."""
    covered: list[str] = []  # planned paths: their submodules are their role's to split
    for path, module in model.named_modules():
        if any(path.startswith(c + ".") for c in covered):
            continue
        role = _role(model, path) if path else None
        if role is None:
            if any(p is not None for p in module._parameters.values()):
                raise ValueError(
                    f"tensor_parallel_size={tp.world_size}: {path} ({type(module).__name__}) "
                    f"holds weights and {type(model).__name__}.tp_plan gives it no role, so "
                    "pagedllm does not know how to split it (use pipeline_parallel_size)")
            continue
        covered.append(path)
        if not holds_module(module):
            continue
        kinds = {"attention": (SelfAttention,), "feed_forward": (GatedMLP, SparseMoeBlock)}
        if role in kinds and not isinstance(module, kinds[role]):
            raise ValueError(f"tensor_parallel_size={tp.world_size}: {path} is planned as "
                             f"{role} but is a {type(module).__name__}")
        yield path, role, module


def _shard_feed_forward(path: str, module: nn.Module, tp: TensorParallelRank,
                        split: MlpSplit) -> Shards:
    """A dense MLP, or a MoE block's experts and shared expert (its router and the shared
    expert's gate replicated)."""
    if isinstance(module, GatedMLP):
        return _shard_mlp(path, module, tp, split)
    shards: Shards = {}
    for i, expert in enumerate(module.experts):
        shards.update(_shard_mlp(f"{path}.experts.{i}", expert, tp, split))
    if module.shared_expert is not None:
        shards.update(_shard_mlp(f"{path}.shared_expert", module.shared_expert, tp, split))
    return shards


def shard_model(model: nn.Module, tp: TensorParallelRank, plan: Optional[QuantPlan]) -> Shards:
    """Shrink a model built on the meta device (before the quantized modules are swapped in) to
    rank tp's share; plan: the GGUF blocks that will be kept (their reduction axis must split
    at whole blocks). Returns the part of each checkpoint tensor the rank loads."""
    modules = list(planned_modules(model, tp))  # every module checked before any is changed
    shards = _shard_vocab(model, tp)
    split = mlp_split(plan)
    grouped = {path for path, q in (plan or {}).items() if q == Q8_0G4}
    for path, role, module in modules:
        if role == "attention":
            shards.update(_shard_attention(path, module, tp, plan))
        elif role == "feed_forward":
            shards.update(_shard_feed_forward(path, module, tp, split))
    cut = sorted(p for p in grouped if plan[p] != Q8_0G4)
    if cut and tp.rank == 0:
        logger.info("int8_g128 with tensor_parallel_size=%d: %d o_proj matrices (%s, ...) take "
                    "%d values a rank, no multiple of 128: they keep a scale per 32 values "
                    "(Q8_0), the rest a scale per 128", tp.world_size, len(cut), cut[0],
                    shards[f"{cut[0]}.weight"].size)
    return shards


def add_collectives(model: nn.Module, tp: TensorParallelRank) -> None:
    """Wrap the loaded model's row-parallel projections, embedding and head in their
    collectives (after loading: the wrappers change the modules' parameter names): a MoE
    block's output as a whole, its experts' down_proj left partial."""
    for path, role, module in list(planned_modules(model, tp)):
        if role == "attention":
            module.o_proj = ReducedOutput(module.o_proj)
        elif role == "feed_forward" and isinstance(module, GatedMLP):
            module.down_proj = ReducedOutput(module.down_proj)
        elif role == "feed_forward":  # a MoE block: one all-reduce of the whole block
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, ReducedOutput(module))
    if holds_module(model.model.embed_tokens):  # a pipeline stage's placeholder stays
        rows = model.model.embed_tokens.num_embeddings
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens,
                                                          tp.rank * rows, rows)
    if holds_module(model.lm_head):
        model.lm_head = GatheredLogits(model.lm_head, tp.world_size)
