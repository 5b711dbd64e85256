"""The sparse MoE block: only the chosen experts run, each once on its own tokens, and the result
equals a dense sum over every expert weighted by the router, and transformers' own blocks."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedllm.config import MoEConfig
from pagedllm.layers.moe import SparseMoeBlock, route

HIDDEN, TOKENS = 64, 11


def random_block(moe: MoEConfig, seed: int = 0) -> SparseMoeBlock:
    """A block with N(0, 0.2^2) weights."""
    block = SparseMoeBlock(HIDDEN, moe)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return block


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))  # [T, H]


@pytest.mark.parametrize("shared", [None, 64])
def test_only_the_chosen_experts_run_each_once_on_its_own_tokens(shared):
    block = random_block(MoEConfig(8, 2, 32, norm_topk_prob=True,
                                   shared_expert_intermediate_size=shared))
    x = inputs()
    seen: dict[int, list[int]] = {}  # expert -> rows it ran on, per call
    for e, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(
            lambda m, args, e=e: seen.setdefault(e, []).append(args[0].shape[0]))
    block(x)
    chosen = route(block.gate(x), 2, True).experts  # [T, 2]
    counts = torch.bincount(chosen.reshape(-1), minlength=8)
    assert set(seen) == set(chosen.unique().tolist()) and len(seen) < 8
    assert {e: rows for e, rows in seen.items()} == {e: [int(counts[e])] for e in seen}
    assert sum(counts.tolist()) == TOKENS * 2  # T*k expert rows, not T*E


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_equals_a_dense_sum_over_all_experts_weighted_by_the_router(norm_topk_prob):
    block = random_block(MoEConfig(8, 3, 32, norm_topk_prob, shared_expert_intermediate_size=64))
    x = inputs()
    with torch.no_grad():
        probs = torch.softmax(block.gate(x), dim=-1)  # [T, E]
        top = probs.topk(3, dim=-1)
        weights = torch.zeros_like(probs).scatter(1, top.indices, top.values)  # [T, E]
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        every = torch.stack([expert(x) for expert in block.experts], dim=1)  # [T, E, H]
        dense = (weights.unsqueeze(-1) * every).sum(dim=1)
        dense += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        torch.testing.assert_close(block(x), dense, rtol=0, atol=1e-5)


def _load_into_transformers(block: SparseMoeBlock, hf: torch.nn.Module) -> None:
    """Copy the block's weights into transformers' block (experts fused [E, 2I, H])."""
    with torch.no_grad():
        hf.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(block.experts):
            hf.experts.gate_up_proj[e].copy_(expert.gate_up_proj.weight)  # [gate | up] rows
            hf.experts.down_proj[e].copy_(expert.down_proj.weight)
        if block.shared_expert is not None:
            shared = block.shared_expert
            i = shared.down_proj.in_features
            hf.shared_expert.gate_proj.weight.copy_(shared.gate_up_proj.weight[:i])
            hf.shared_expert.up_proj.weight.copy_(shared.gate_up_proj.weight[i:])
            hf.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            hf.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)


@pytest.mark.parametrize("family,norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False),
                                                   ("qwen2_moe", False), ("qwen2_moe", True)])
def test_matches_transformers_blocks(family, norm_topk_prob):
    sizes = dict(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=norm_topk_prob)
    if family == "qwen2_moe":
        hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(shared_expert_intermediate_size=64, **sizes))
        moe = MoEConfig(8, 2, 32, norm_topk_prob, shared_expert_intermediate_size=64)
    else:
        hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**sizes))
        moe = MoEConfig(8, 2, 32, norm_topk_prob)
    block = random_block(moe, seed=3)
    _load_into_transformers(block, hf)
    x = inputs(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf(x.unsqueeze(0))[0], rtol=0, atol=1e-5)
