"""Gated feed-forward: SwiGLU, the dense MLP of most families here and each expert of a MoE
layer, or GeGLU (Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.ggml_linear import BF16, GGMLLinear, GGMLMergedLinear
from pagedllm.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up merged into one matmul; act is silu, or
    gelu_tanh with gelu=True."""

    def __init__(self, hidden_size: int, intermediate_size: int, gelu: bool = False) -> None:
        super().__init__()
        i = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, (i, i), ("gate_proj", "up_proj"), bias=False)
        self.down_proj = nn.Linear(i, hidden_size, bias=False)
        self.act = GeluTanhAndMul() if gelu else SiluAndMul()
        self.gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if (type(gate_up) is GGMLMergedLinear and gate_up.packed and gate_up.bias is None
                and self.act.impl == "cpu" and x.dtype == torch.float32):
            # one C++ call: the act's C++ op applied as the gate/up matmul stores (bf16 matrices),
            # or after it (block types); the same numbers as the two steps below (a LoRA-wrapped
            # gate_up_proj takes those, its deltas going between the matmul and act). Before a
            # packed BF16 down_proj the values come rounded to bf16, as its kernels round them.
            down = self.down_proj
            bf16 = type(down) is GGMLLinear and down.packed and down.qtype == BF16
            act = torch.ops.pagedllm.ggml_gated_x8(
                x.reshape(-1, gate_up.in_features), list(gate_up.weights),
                [int(t) for t in gate_up.qtypes], gate_up.in_features, self.gelu, bf16)
            if act.dtype != torch.bfloat16:
                return down(act.view(*x.shape[:-1], act.shape[-1]))
            y = torch.ops.pagedllm.ggml_linear_x8(act, [down.weight], [int(down.qtype)],
                                                  down.in_features)[0]
            y = y.view(*x.shape[:-1], down.out_features)
            return y if down.bias is None else y + down.bias
        return self.down_proj(self.act(*gate_up(x)))
