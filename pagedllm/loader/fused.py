"""Fused checkpoint tensors (Phi-3's qkv_proj and gate_up_proj) split by rows into the shards
the model's merged layers load (q_proj, k_proj, v_proj; gate_proj, up_proj), and stacked expert
tensors (llama.cpp's ffn_gate_exps [experts, rows, cols]) split into one matrix per expert.

A fused matrix is its shards stacked by rows, and a GGML block never crosses a row, so a row
range of the fused tensor is exactly one shard, in float or in blocks:

    qkv_proj.weight  [q rows | k rows | v rows] x in_features
    -> q_proj.weight rows [0, q), k_proj.weight rows [q, q + k), v_proj.weight rows [q + k, ...)

A stacked expert tensor read as [experts * rows, cols] is the same: expert e is rows
[e * rows, (e + 1) * rows), loaded as mlp.experts.e.gate_proj.weight.

Under tensor parallelism a shard split by output rows (pagedllm/shard.py's Shard, axis
0) takes its rank's rows of its own range, so a rank reads several row ranges of one fused
tensor (rank 1 of 2, q and k/v of 64 and 32 rows: [32, 64), [80, 96), [112, 128)); a shard
split along the reduction axis (an expert's down_proj) takes all its rows, and the loader
cuts its columns as for any other row-parallel tensor.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import torch

from pagedllm.shard import Shard

# fused module name -> its shards' module names, in row order
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class RowSlice(NamedTuple):
    """One shard's rows in a fused tensor of `total` rows."""

    name: str  # the destination parameter, e.g. "model.layers.0.self_attn.k_proj.weight"
    start: int
    rows: int
    total: int


def shard_modules(module: str) -> Optional[tuple[str, ...]]:
    """The shard module names of a fused module name ("...self_attn.qkv_proj" ->
    "...self_attn.q_proj", ...), or None when it is not a fused module."""
    parent, _, last = module.rpartition(".")
    if last not in FUSED_SHARDS:
        return None
    return tuple(f"{parent}.{s}" if parent else s for s in FUSED_SHARDS[last])


def stacked_modules(module: str, count: int) -> Optional[tuple[str, ...]]:
    """The per-expert module names of a stacked expert module name ("...mlp.experts.gate_proj"
    -> "...mlp.experts.0.gate_proj", ...), or None when it is not a stacked expert module."""
    parent, _, last = module.rpartition(".")
    if parent.rpartition(".")[2] != "experts":
        return None
    return tuple(f"{parent}.{e}.{last}" for e in range(count))


def _row_slices(dests: list[str], params: Mapping[str, torch.Tensor],
                shards: Optional[Mapping[str, Shard]] = None) -> list[RowSlice]:
    """One row range per destination, its own rows of the destinations' consecutive ranges:
    all of them, or a tensor-parallel rank's part when its shard splits output rows."""
    shards = shards or {}
    split = [(d, shards[d] if d in shards and shards[d].axis == 0 else None) for d in dests]
    sizes = [params[d].shape[0] if s is None else s.full for d, s in split]
    slices, start = [], 0
    for (d, s), size in zip(split, sizes):
        slices.append(RowSlice(d, start, size, sum(sizes)) if s is None
                      else RowSlice(d, start + s.start, s.size, sum(sizes)))
        start += size
    return slices


def split_stacked(name: str, params: Mapping[str, torch.Tensor],
                  shards: Optional[Mapping[str, Shard]] = None) -> Optional[list[RowSlice]]:
    """Where the rows of a stacked expert tensor (`...mlp.experts.gate_proj.weight`, all
    experts' matrices one after another) go: to experts 0, 1, ... of the model (a tensor
    parallel rank: each expert's part, `shards`), or None when it is not one."""
    module, _, kind = name.rpartition(".")
    experts = stacked_modules(module, 0)
    if name in params or experts is None:
        return None
    parent, _, proj = module.rpartition(".")
    dests: list[str] = []
    while f"{parent}.{len(dests)}.{proj}.{kind}" in params:
        dests.append(f"{parent}.{len(dests)}.{proj}.{kind}")
    return _row_slices(dests, params, shards) if dests else None


def split_fused(name: str, params: Mapping[str, torch.Tensor],
                shards: Optional[Mapping[str, Shard]] = None) -> Optional[list[RowSlice]]:
    """Where the rows of checkpoint tensor `name` go when the model holds its shards instead
    (each shard as many rows as its destination, or a tensor-parallel rank's part of its
    rows, `shards`), or None when the model loads it whole or it is not a fused tensor. A
    ValueError naming it when a rank holds a shard's columns (a fused tensor's shards split by
    output rows)."""
    module, _, kind = name.rpartition(".")  # "...qkv_proj", "weight"
    modules = shard_modules(module)
    if name in params or modules is None:
        return None
    dests = [f"{m}.{kind}" for m in modules]
    if not all(d in params for d in dests):
        return None
    by_columns = [d for d in dests if d in (shards or {}) and shards[d].axis != 0]
    if by_columns:
        raise ValueError(f"checkpoint tensor {name!r} is fused, and tensor parallelism splits "
                         f"its shard {by_columns[0]!r} along the reduction axis: a fused "
                         "tensor's shards split by output rows only")
    return _row_slices(dests, params, shards)
