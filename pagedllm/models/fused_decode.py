"""A C++ decode step over all decoder layers (kernels/csrc/decode_stack.cpp), for models whose
weights are all x8 block matrices on the CPU.

At one token a step, the Python between a layer's ops (module calls, views, ~25 dispatched ops)
costs about as much as a third of the layer's matmuls. The stack runs the same kernels in the same
order without it; steps with a prompt chunk keep the Python layers.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.kernels import kernels_loaded
from pagedllm.layers.ggml_linear import GGMLLinear


def _packed(*modules: nn.Module) -> bool:
    return all(isinstance(m, GGMLLinear) and m.packed for m in modules)


def _float32_cpu(*tensors: Optional[torch.Tensor]) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def _layer_args(layer: nn.Module) -> Optional[tuple]:
    """add_layer() arguments for a Llama/Qwen2 decoder layer, or None when it cannot be fused."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
               mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not _packed(*linears) or any(m.bias is not None for m in linears[3:]):
        return None
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if not _float32_cpu(*biases, *norms):
        return None
    return ([m.weight for m in linears], [int(m.qtype) for m in linears],
            [b for b in biases if b is not None], *norms)


def enable_fused_decode(model: nn.Module) -> bool:
    """Give a Llama-family model its C++ decode step when every layer can take it; True if so."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "fused_decode") or not kernels_loaded():
        return False
    args = [_layer_args(layer) for layer in layers]
    if not args or any(a is None for a in args) or not _float32_cpu(model.rope.cos):
        return False
    attn, norm = layers[0].self_attn, layers[0].input_layernorm
    stack = torch.classes.pagedllm.DecodeStack(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                               norm.eps, attn.scale, model.rope.cos,
                                               model.rope.sin)
    for a in args:
        stack.add_layer(*a)
    model.fused_decode = stack
    return True
