"""Checkpoint tensor names of a model's parameters, merged modules' shards included."""
from __future__ import annotations

import torch
from torch import nn


def checkpoint_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor it loads into: parameters by their own names,
    merged modules' shards by the checkpoint's names (q_proj.weight, ...)."""
    params: dict[str, torch.Tensor] = {}
    merged = {path: m for path, m in model.named_modules() if hasattr(m, "shard_tensors")}
    in_merged = {id(p) for m in merged.values() for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) not in in_merged:
            params[name] = param
    for path, module in merged.items():
        parent = path.rpartition(".")[0]
        for local, tensor in module.shard_tensors().items():
            params[f"{parent}.{local}" if parent else local] = tensor
    return params
