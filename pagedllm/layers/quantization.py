"""Quantized weights, added to a plain model by swapping modules (the model code knows nothing of it).

- A GGUF's quantized tensors stay in their block format: the loader fills GGMLLinear /
  GGMLEmbedding modules with the file's bytes (exact: the kernels dequantize to the very
  values ggml produces).
- Float checkpoints can be quantized at load (`quantization="int8"` or `"int4"`) into the same
  block formats, row slice by row slice as the loader reads them (loader/row_encoding.py):
  int8 is Q8_0 (32 values share an fp16 scale); int4 is Q4_1 (32 values share an fp16 scale
  and minimum) for the decoder's linear layers, with the embedding and output head
  kept in Q8_0, as llama.cpp's 4-bit mixes keep them at higher precision.
- `quantization="int8_g128"` is int8 with one scale per 128 values of a row (pagedllm's own
  Q8_0G4: Q8_0 blocks whose groups of 4 share the scale), against x quantized per 128 values
  too, so the kernels make a quarter of Q8_0's float updates (prompt steps 1.2-1.7x faster on the
  AMX tiles); a matrix whose rows are no multiple of 128 values wide stays in Q8_0.
- `quantization="bf16"` keeps every matrix (embedding and head too) in bf16 (ggml type BF16):
  exact for a bf16 checkpoint, whose default on the CPU it is; the kernels compute in float32.
"""
from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.kernels.types import Q8_0G4, Q8_GROUP_BLOCKS
from pagedllm.layers.ggml_linear import GGMLEmbedding, GGMLLinear, GGMLMergedLinear
from pagedllm.layers.linear import MergedLinear

# checkpoint module name (e.g. "model.layers.0.mlp.up_proj") -> block format of its weight; a
# merged module (gate_up_proj) is swapped when every one of its shards is in the plan
QuantPlan = dict[str, GGMLQuantizationType]

Q8_0, Q4_1, BF16 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.BF16


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _shard_names(path: str, module: MergedLinear) -> list[str]:
    """Checkpoint module names of a merged module's shards ("...self_attn.q_proj", ...)."""
    parent = path.rpartition(".")[0]
    return [f"{parent}.{name}" if parent else name for name in module.shard_names]


def _quantized_like(old: nn.Module, qtypes: list[GGMLQuantizationType],
                    dtype: torch.dtype) -> nn.Module:
    if isinstance(old, MergedLinear):
        return GGMLMergedLinear(old.in_features, old.output_sizes, old.shard_names, qtypes,
                                old.bias is not None, dtype)
    if isinstance(old, nn.Embedding):
        return GGMLEmbedding(old.num_embeddings, old.embedding_dim, qtypes[0])
    if isinstance(old, nn.Linear):
        return GGMLLinear(old.in_features, old.out_features, qtypes[0], old.bias is not None, dtype)
    raise TypeError(f"cannot quantize {type(old).__name__}")


def _planned(model: nn.Module, plan: QuantPlan) -> list[tuple[str, list[GGMLQuantizationType]]]:
    """(module path, block format of each of its matrices) for the modules plan covers whole."""
    out = []
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            names = _shard_names(path, module)
            if all(n in plan for n in names):
                out.append((path, [plan[n] for n in names]))
        elif isinstance(module, (nn.Linear, nn.Embedding)) and path in plan:
            out.append((path, [plan[path]]))
    return out


def swap_quantized_modules(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> None:
    """Replace each planned nn.Linear / nn.Embedding / MergedLinear by its block-format twin
    (weights unset). A merged module with a shard outside the plan stays dense."""
    for path, qtypes in _planned(model, plan):
        parent, attr = _parent(model, path)
        setattr(parent, attr, _quantized_like(getattr(parent, attr), qtypes, dtype))


def _q8_0_blocks(w: torch.Tensor, blocks_per_scale: int) -> torch.Tensor:
    """Q8_0 blocks [N, K/32*34] of [N, K] whose runs of blocks_per_scale blocks share one fp16
    scale d = max|w| / 127 over their values (each block carries it)."""
    n, k = w.shape
    g = 32 * blocks_per_scale
    groups = w.float().reshape(n, k // g, g)
    d = (groups.abs().amax(-1, keepdim=True) / 127).half()  # [N, G, 1]
    df = d.float()
    q = torch.where(df > 0, groups / df.clamp_min(1e-30), 0.0).round().clamp(-127, 127)
    q = q.to(torch.int8).view(torch.uint8).reshape(n, k // g, blocks_per_scale, 32)
    scales = d.view(torch.uint8).reshape(n, k // g, 1, 2).expand(n, k // g, blocks_per_scale, 2)
    return torch.cat([scales, q], -1).reshape(n, -1)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [N, K/32*34] of a float matrix [N, K]: w ~ d * q, q int8, d fp16 per 32."""
    return _q8_0_blocks(w, 1)


def quantize_q8_0g4(w: torch.Tensor) -> torch.Tensor:
    """Q8_0G4 blocks [N, K/32*34] of [N, K], K a multiple of 128: Q8_0 blocks, each group of 4
    carrying the same fp16 scale d = max|w| / 127 over its 128 values."""
    g = 32 * Q8_GROUP_BLOCKS
    if w.shape[1] % g:
        raise ValueError(f"int8_g128 needs rows of a multiple of {g} values; got {w.shape[1]}")
    return _q8_0_blocks(w, Q8_GROUP_BLOCKS)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [N, K/32*20] of [N, K]: w ~ d * q + m, q in 0..15, d and m fp16 per 32."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half(), lo.half()
    df, mf = d.float(), m.float()
    q = torch.where(df > 0, (blocks - mf) / df.clamp_min(1e-30), 0.0).round().clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # value j in the low nibble, j + 16 in the high
    return torch.cat([d.view(torch.uint8), m.view(torch.uint8), packed], -1).reshape(n, -1)


def quantize_bf16(w: torch.Tensor) -> torch.Tensor:
    """BF16 rows [N, 2K] (bytes) of [N, K]: round to nearest even, exact for bf16 values."""
    return w.to(torch.bfloat16).contiguous().view(torch.uint8)


_QUANTIZERS = {Q8_0: quantize_q8_0, Q4_1: quantize_q4_1, BF16: quantize_bf16, Q8_0G4: quantize_q8_0g4}
# quantization= -> (the layers' matrices, the embedding and head)
_METHOD_TYPES = {"int8": (Q8_0, Q8_0), "int4": (Q4_1, Q8_0), "bf16": (BF16, BF16),
                 "int8_g128": (Q8_0G4, Q8_0G4)}


def _fitting(qtype, width: int):
    """Q8_0G4 for rows of a multiple of 128 values, else Q8_0 (the same int8, a scale per 32)."""
    return Q8_0 if qtype == Q8_0G4 and width % (32 * Q8_GROUP_BLOCKS) else qtype


def float_quant_plan(model: nn.Module, method: str) -> QuantPlan:
    """Block format per checkpoint module for a float model with int8, int8_g128, int4 or bf16."""
    matrix, big = _METHOD_TYPES[method]
    plan: QuantPlan = {}
    for name, module in model.named_modules():
        if name in ("model.embed_tokens", "lm_head"):
            width = (module.embedding_dim if isinstance(module, nn.Embedding)
                     else getattr(module, "in_features", 1))
            plan[name] = _fitting(big, width)
        elif isinstance(module, nn.Linear):
            plan[name] = _fitting(matrix, module.in_features)
        elif isinstance(module, MergedLinear):
            for shard in _shard_names(name, module):
                plan[shard] = _fitting(matrix, module.in_features)
    return plan


def block_quantizers(model: nn.Module) -> dict[int, tuple[int, Callable[[torch.Tensor], torch.Tensor]]]:
    """id of each block-format weight of a model built with a float_quant_plan -> (its float
    columns, the quantizer of its format): what the loader encodes float rows with."""
    out: dict[int, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {}
    for module in model.modules():
        if isinstance(module, GGMLMergedLinear):
            for weight, qtype in zip(module.weights, module.qtypes):
                out[id(weight)] = (module.in_features, _QUANTIZERS[qtype])
        elif isinstance(module, GGMLLinear):
            out[id(module.weight)] = (module.in_features, _QUANTIZERS[module.qtype])
        elif isinstance(module, GGMLEmbedding):
            out[id(module.weight)] = (module.embedding_dim, _QUANTIZERS[module.qtype])
    return out
