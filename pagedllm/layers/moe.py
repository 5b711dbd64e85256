"""A sparse MoE feed-forward block (Qwen2-MoE, Qwen3-MoE): a softmax router picks top-k SwiGLU
experts per token, and only those experts run, each on just the tokens routed to it.

Each expert is an ordinary GatedMLP, so a GGUF's stacked expert tensors load one expert per
module and keep their blocks like any other matrix (layers/quantization.py swaps them). A step
groups its (token, choice) slots by expert:

    experts [T, k] -> flat [T*k] -> stable sort -> slots of expert 0 | expert 1 | ... | E-1
    expert e: x[tokens of its slots] [n_e, H] -> gate/up/down -> * routing weight -> index_add_

so an expert no token chose is never read, and the work is T*k expert rows, not T*E.

Where every expert is an x8 matrix on the CPU (a GGUF's kept blocks, int8 or bf16 at load), the
whole block is one C++ op instead (kernels/csrc/moe.cpp, `pagedllm::moe_forward`): the same
routing and sums, each row computed alone whatever the batch, and the very op the C++ decode
stack calls, so that the captured step equals this loop.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from pagedllm.config import MoEConfig
from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.mlp import GatedMLP


class Routing(NamedTuple):
    """Each token's chosen experts and their weights."""

    experts: torch.Tensor  # [T, k] int64 expert ids, best first
    weights: torch.Tensor  # [T, k] float32


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """transformers' Qwen MoE routing: softmax over all experts in float32, then the top k of
    those probabilities, rescaled to sum to 1 when norm_topk_prob."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a sigmoid-gated shared expert."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe.moe_intermediate_size)
                                     for _ in range(moe.num_experts))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = None if shared is None else GatedMLP(hidden_size, shared)
        self.shared_expert_gate: Optional[nn.Linear] = (
            None if shared is None else nn.Linear(hidden_size, 1, bias=False))
        self._x8_args: Optional[tuple] = None  # x8_args() once found (None: not yet, or not x8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        args = self.x8_args() if x.device.type == "cpu" else None
        if args is not None:
            return torch.ops.pagedllm.moe_forward(x, *args).to(x.dtype)
        routing = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.routed(x, routing)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return out

    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(x), running every chosen
        expert once on the rows routed to it (in expert order, as transformers adds them)."""
        flat = routing.experts.reshape(-1)  # [T*k] expert of each slot
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k  # [T*k] the token of each grouped slot
        weights = routing.weights.reshape(-1)[order].unsqueeze(1)  # [T*k, 1]
        rows = x[tokens]  # [T*k, H]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                part = slice(start, start + n)
                y = expert(rows[part]) * weights[part]  # [n, H] float32
                out.index_add_(0, tokens[part], y.to(out.dtype))
            start += n
        return out

    def x8_args(self) -> Optional[tuple]:
        """moe_forward's arguments after x where every expert (and the shared one) is an x8
        matrix without biases and the router and shared gate are x8 or float32, else None.
        Found once and kept: pack_x8 regroups the matrices at load, before any step, and
        nothing replaces them after (looking them up took ~0.27 ms a layer with 32 experts,
        on every call of the layer loop)."""
        if self._x8_args is None:
            self._x8_args = self._find_x8_args()
        return self._x8_args

    def _find_x8_args(self) -> Optional[tuple]:
        router = _matrix_arg(self.gate)
        if router is None:
            return None
        experts = []
        for expert in self.experts:  # (a float model stops at the first)
            args = x8_mlp_args(expert)
            if args is None:
                return None
            experts.append(args)
        shared: list[torch.Tensor] = []
        shared_types: list[int] = []
        if self.shared_expert is not None:
            mlp, gate = x8_mlp_args(self.shared_expert), _matrix_arg(self.shared_expert_gate)
            if mlp is None or gate is None:
                return None
            shared, shared_types = [*mlp[0], gate[0]], [*mlp[1], gate[1]]
        return (router[0], router[1], [w for e in experts for w in e[0]],
                [t for e in experts for t in e[1]], self.top_k, self.norm_topk_prob, shared,
                shared_types)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


def _x8(module: nn.Module) -> bool:
    """An x8 matrix module (a GGML block or bf16 weight regrouped by pack_x8) without a bias."""
    return bool(getattr(module, "packed", False)) and getattr(module, "bias", None) is None


def x8_mlp_args(mlp: nn.Module, gelu: bool = False
                ) -> Optional[tuple[list[torch.Tensor], list[int]]]:
    """A GatedMLP's gate, up, down x8 matrices (no biases) and their ggml types, or None; its
    activation SwiGLU, or also GeGLU with gelu=True (the C++ decode stack's dense layers)."""
    acts = (SiluAndMul, GeluTanhAndMul) if gelu else SiluAndMul
    if not isinstance(mlp, GatedMLP) or not isinstance(mlp.act, acts):
        return None
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if not (_x8(gate_up) and _x8(down)):
        return None
    return [*gate_up.weights, down.weight], [int(t) for t in (*gate_up.qtypes, down.qtype)]


def _matrix_arg(linear: nn.Module) -> Optional[tuple[torch.Tensor, int]]:
    """A router or gate: an x8 matrix and its type, or a float32 nn.Linear's weight and -1."""
    if _x8(linear):
        return linear.weight, int(linear.qtype)
    if (type(linear) is nn.Linear and linear.bias is None
            and linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"):
        return linear.weight, -1
    return None
