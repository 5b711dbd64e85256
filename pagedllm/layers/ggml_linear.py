"""Linear and embedding layers whose weights stay in a GGML block format (as a GGUF stores them).

The weight is a uint8 tensor [out_features, row_bytes]: each row is in_features / block_size
blocks. On the CPU, pack_x8() then regroups the blocks eight rows at a time (the same bits,
reordered; ggml_x8.cpp), and every batch size runs the int8 kernel over that layout. Weights
left in the GGUF layout (rows not a multiple of 8, or not packed) run the float32 row kernel on
small batches and dequantize + BLAS GEMM on large ones.

A float checkpoint's matrices kept in bf16 (quantization="bf16") are ggml type BF16 here: rows
of 2-byte values, regrouped eight rows at a time by bf16_pack_x8 and multiplied by the bf16 x8
kernels (csrc/x8_bf16.cpp) through the same ggml_linear_x8 call, so the decode stack takes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.kernels.types import (FLOAT_X8_TYPES, KERNEL_TYPES, X8_OWN_TYPES, X8_TYPES,  # noqa: F401
                                    block_sizes)

BF16 = GGMLQuantizationType.BF16

X8_ROWS = 8

# Weights left in the GGUF layout (rows not a multiple of 8): from this many rows on, dequantize
# + GEMM; below, the float32 row kernel.
DENSE_MIN_ROWS = 64
# The dense path dequantizes this many values at a time (8 MiB of float32): a vocabulary-sized
# matrix at once would be a fresh 0.5 GB allocation, page-faulted in on every call.
DENSE_CHUNK_ELEMENTS = 2 * 1024 * 1024


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one weight row of in_features values."""
    block, size = block_sizes(qtype)
    if in_features % block:
        raise ValueError(f"in_features={in_features} is not a multiple of the {qtype.name} "
                         f"block size {block}")
    return in_features // block * size


def dequantize(weight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """float32 [rows, in_features] from block-format rows [rows, row_bytes]."""
    if qtype == BF16:  # exact: bf16 widens to float32 without rounding
        return weight.view(torch.bfloat16).float()
    return torch.ops.pagedllm.ggml_dequant(weight, int(qtype), in_features)


def ggml_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType,
                in_features: int) -> torch.Tensor:
    """x [..., in_features] @ W^T -> [..., out_features] in x's dtype."""
    flat = x.reshape(-1, in_features)  # [M, K]
    if flat.shape[0] >= DENSE_MIN_ROWS or qtype == BF16:  # BF16 has no row kernel
        y = _dense_matmul(flat, weight, qtype, in_features)
    else:
        y = torch.ops.pagedllm.ggml_linear(flat, weight, int(qtype), in_features).to(x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def _dense_matmul(flat: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType,
                  in_features: int) -> torch.Tensor:
    """flat [M, K] @ W^T through float GEMMs on row chunks of W dequantized one at a time."""
    n = weight.shape[0]
    step = max(1, DENSE_CHUNK_ELEMENTS // in_features)
    if step >= n:
        w = dequantize(weight, qtype, in_features)  # [N, K] float32
        return F.linear(flat, w.to(flat.dtype))
    y = torch.empty(flat.shape[0], n, dtype=flat.dtype)
    for r0 in range(0, n, step):
        w = dequantize(weight[r0:r0 + step], qtype, in_features)  # [step, K]
        y[:, r0:r0 + step] = F.linear(flat, w.to(flat.dtype))
    return y


class GGMLLinear(nn.Module):
    """y = x W^T + b with W in a GGML block format; b (if any) in the model dtype."""

    def __init__(self, in_features: int, out_features: int, qtype: GGMLQuantizationType,
                 bias: bool, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = nn.Parameter(torch.empty(out_features, row_bytes(qtype, in_features),
                                               dtype=torch.uint8), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.packed = False  # True once pack_x8() has regrouped the weight [rows / 8, bytes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            y = torch.ops.pagedllm.ggml_linear_x8(x.reshape(-1, self.in_features), [self.weight],
                                                  [int(self.qtype)], self.in_features)[0]
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        else:
            y = ggml_matmul(x, self.weight, self.qtype, self.in_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}, packed={self.packed}")


class GGMLEmbedding(nn.Module):
    """Embedding rows kept in a GGML block format; looked-up rows are dequantized on the fly."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: GGMLQuantizationType) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, embedding_dim, qtype
        self.weight = nn.Parameter(torch.empty(num_embeddings, row_bytes(qtype, embedding_dim),
                                               dtype=torch.uint8), requires_grad=False)
        self.packed = False  # shares an x8 weight with a tied output head after pack_x8()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed and self.qtype == BF16:
            rows = torch.ops.pagedllm.bf16_embed_x8(self.weight, ids.reshape(-1), self.embedding_dim)
        elif self.packed:
            rows = torch.ops.pagedllm.ggml_embed_x8(self.weight, ids.reshape(-1), int(self.qtype),
                                                    self.embedding_dim)
        else:
            picked = self.weight.index_select(0, ids.reshape(-1))  # [T, row_bytes]
            rows = dequantize(picked, self.qtype, self.embedding_dim)
        return rows.view(*ids.shape, -1)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}, "
                f"packed={self.packed}")


class GGMLMergedLinear(nn.Module):
    """A MergedLinear (q/k/v, gate/up) whose shards stay in GGML block formats, each its own type
    (a Q4_K_M file mixes them); packed, all shards run in one kernel call (x quantized once)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 qtypes: Sequence[GGMLQuantizationType], bias: bool,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes, self.shard_names = tuple(output_sizes), tuple(shard_names)
        self.qtypes = tuple(qtypes)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(n, row_bytes(qt, in_features), dtype=torch.uint8),
                         requires_grad=False) for n, qt in zip(output_sizes, qtypes))
        self.bias = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype)) if bias else None
        self.packed = False  # True once pack_x8() has regrouped every shard

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in_features] -> one [..., size_i] tensor per shard."""
        flat = x.reshape(-1, self.in_features)
        if self.packed:
            ys = torch.ops.pagedllm.ggml_linear_x8(flat, list(self.weights),
                                                   [int(t) for t in self.qtypes], self.in_features)
        else:
            ys = [ggml_matmul(flat, w, qt, self.in_features)
                  for w, qt in zip(self.weights, self.qtypes)]
        outs, start = [], 0
        for y, n in zip(ys, self.output_sizes):
            y = y.to(x.dtype).view(*x.shape[:-1], n)
            if self.bias is not None:
                y = y.add_(self.bias[start:start + n])
            outs.append(y)
            start += n
        return tuple(outs)

    def shard_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint-relative names ("q_proj.weight", ...) -> the tensors they load into."""
        out, start = {}, 0
        for name, w, n in zip(self.shard_names, self.weights, self.output_sizes):
            out[f"{name}.weight"] = w
            if self.bias is not None:
                out[f"{name}.bias"] = self.bias[start:start + n]
            start += n
        return out

    def extra_repr(self) -> str:
        types = ", ".join(f"{n}={t.name}" for n, t in zip(self.shard_names, self.qtypes))
        return f"in_features={self.in_features}, {types}, bias={self.bias is not None}, packed={self.packed}"


BlockModule = (GGMLLinear, GGMLEmbedding, GGMLMergedLinear)


def _x8_type(qtype: GGMLQuantizationType, k: int) -> bool:
    """Whether matrices of qtype, k wide, have an eight-row layout (BF16's quads: k % 4 == 0)."""
    return qtype in X8_TYPES or qtype in X8_OWN_TYPES or (qtype in FLOAT_X8_TYPES and k % 4 == 0)


def _packable(module: nn.Module) -> bool:
    if isinstance(module, GGMLMergedLinear):
        # one ggml_linear_x8 call takes all shards: BF16 ones cannot mix with block types
        bf16 = {qt in FLOAT_X8_TYPES for qt in module.qtypes}
        return len(bf16) == 1 and all(
            _x8_type(qt, module.in_features) and n % X8_ROWS == 0 and w.device.type == "cpu"
            for qt, n, w in zip(module.qtypes, module.output_sizes, module.weights))
    rows = module.out_features if isinstance(module, GGMLLinear) else module.num_embeddings
    k = module.in_features if isinstance(module, GGMLLinear) else module.embedding_dim
    return (_x8_type(module.qtype, k) and rows % X8_ROWS == 0
            and module.weight.device.type == "cpu")


def _as_param(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(weight, requires_grad=False)


@dataclass(frozen=True)
class X8Slot:
    """One block weight pack_x8 regroups: its tensor as loaded, its type and row length, and
    where the regrouped tensor goes (every module sharing it)."""

    source: torch.Tensor  # [rows, row_bytes] GGUF blocks
    shape: tuple[int, int]  # the source's, kept: a file-backed load empties the source
    qtype: GGMLQuantizationType
    k: int  # values per row
    put: Callable[[torch.Tensor], None]


def _merged_put(module: "GGMLMergedLinear", i: int) -> Callable[[torch.Tensor], None]:
    def put(weight: torch.Tensor) -> None:
        module.weights[i] = _as_param(weight)
        # packed once every shard holds its regrouped [rows / 8, bytes] tensor
        module.packed = all(w.dim() == 2 and w.shape[0] * X8_ROWS == n
                            for w, n in zip(module.weights, module.output_sizes))
    return put


def _shared_put(users: list[nn.Module]) -> Callable[[torch.Tensor], None]:
    def put(weight: torch.Tensor) -> None:
        param = _as_param(weight)
        for m in users:
            m.weight, m.packed = param, True
    return put


def x8_slots(model: nn.Module) -> list[X8Slot]:
    """The CPU block weights of model that pack_x8 regroups, in module order (the order a step
    reads them); a weight shared by several modules (tied embedding and head) is one slot."""
    groups: dict[int, list[nn.Module]] = {}  # first weight's id -> modules sharing it
    for m in model.modules():
        if isinstance(m, GGMLMergedLinear):
            groups[id(m)] = [m]
        elif isinstance(m, (GGMLLinear, GGMLEmbedding)):
            groups.setdefault(id(m.weight), []).append(m)
    slots: list[X8Slot] = []
    for users in groups.values():
        first = users[0]
        if first.packed or not all(_packable(m) for m in users):
            continue
        if isinstance(first, GGMLMergedLinear):
            slots.extend(X8Slot(w, tuple(w.shape), qt, first.in_features, _merged_put(first, i))
                         for i, (w, qt) in enumerate(zip(first.weights, first.qtypes)))
            continue
        k = first.in_features if isinstance(first, GGMLLinear) else first.embedding_dim
        slots.append(X8Slot(first.weight, tuple(first.weight.shape), first.qtype, k,
                            _shared_put(users)))
    return slots


def pack_slot(slot: X8Slot) -> torch.Tensor:
    """The slot's weight regrouped eight rows at a time [rows / 8, bytes] (not yet put)."""
    if slot.qtype == BF16:
        return torch.ops.pagedllm.bf16_pack_x8(slot.source.view(torch.bfloat16))
    return torch.ops.pagedllm.ggml_pack_x8(slot.source, int(slot.qtype), slot.k)


@torch.no_grad()
def pack_x8(model: nn.Module) -> int:
    """Regroup the CPU block weights of model eight rows at a time for the x8 kernels, in place;
    a weight shared by several modules (tied embedding and head) is packed once and stays
    shared. Returns the number of tensors packed. Weights are packed in module order, so each
    layer's matrices are allocated together, in the order a step reads them. Each source is
    released once its regrouped copy is put (when the caller holds no other reference to it),
    so the load's peak holds one matrix twice, not every one."""
    slots = x8_slots(model)
    count = len(slots)
    slots.reverse()
    while slots:
        slot = slots.pop()
        slot.put(pack_slot(slot))
        del slot
    return count
