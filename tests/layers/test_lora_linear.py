"""LoRALinear over a dense and a merged linear, in plain PyTorch and with the C++ op (each test
runs both, the choice forced by the build context): each token group gets its slot's delta,
tokens in no group get the base output, and a cleared slot adds nothing; the C++ op gives a row
the same bits whatever else is in the step."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from pagedllm.kernels import kernels_loaded, load_kernels
from pagedllm.layers.custom_op import build_context
from pagedllm.layers.linear import MergedLinear
from pagedllm.layers.lora import LoRAGroup, LoRALinear, set_lora_groups
from pagedllm.platforms import cpu_platform

CPU = torch.device("cpu")


@pytest.fixture(params=["native", "cpu"])
def make(request):
    """LoRALinear(...) built to run forward_<param>: plain PyTorch, or the C++ op."""
    if request.param == "cpu":
        load_kernels()
        if not kernels_loaded():
            pytest.skip("no compiled CPU kernels")

    def build(*args, **kwargs) -> LoRALinear:
        with build_context(cpu_platform(), torch.float32) if request.param == "cpu" \
                else nullcontext():
            layer = LoRALinear(*args, **kwargs)
        assert layer.impl == request.param
        return layer
    return build


def _delta(x, a, b, scale):
    return scale * (x @ a.t()) @ b.t()


def test_each_group_gets_its_slots_delta_on_a_dense_linear(make):
    torch.manual_seed(0)
    base = nn.Linear(6, 5, bias=True)
    wrapped = make(base, 6, (5,), max_loras=2, max_rank=4, device=CPU)
    a0, b0, a1, b1 = torch.randn(3, 6), torch.randn(5, 3), torch.randn(2, 6), torch.randn(5, 2)
    wrapped.set_slot(0, 0, a0, b0, 0.5)
    wrapped.set_slot(1, 0, a1, b1, 2.0)
    x = torch.randn(5, 6)
    groups = (LoRAGroup(1, torch.tensor([0, 3])), LoRAGroup(0, torch.tensor([2])))
    with torch.no_grad():
        plain = wrapped(x)  # outside set_lora_groups: the base alone
        with set_lora_groups(groups, x.shape[0]):
            y = wrapped(x)
    torch.testing.assert_close(plain, base(x))
    want = base(x).detach().clone()
    want[[0, 3]] += _delta(x[[0, 3]], a1, b1, 2.0)
    want[2] += _delta(x[2:3], a0, b0, 0.5)[0]
    torch.testing.assert_close(y, want)
    assert torch.equal(y[[1, 4]], base(x)[[1, 4]])  # rows of no adapter: untouched


def test_a_merged_linear_gets_each_shards_delta_and_a_cleared_slot_none(make):
    torch.manual_seed(1)
    base = MergedLinear(4, (6, 2), ("q_proj", "k_proj"), bias=False)
    nn.init.normal_(base.weight)
    wrapped = make(base, 4, base.output_sizes, max_loras=1, max_rank=2, device=CPU)
    a, b = torch.randn(2, 4), torch.randn(2, 2)  # k_proj only
    wrapped.set_slot(0, 1, a, b, 1.0)
    x = torch.randn(3, 4)
    groups = (LoRAGroup(0, torch.arange(3)),)
    with torch.no_grad(), set_lora_groups(groups, x.shape[0]):
        q, k = wrapped(x)
        q0, k0 = base(x)
        torch.testing.assert_close(q, q0)
        torch.testing.assert_close(k, k0 + _delta(x, a, b, 1.0))
        wrapped.clear_slot(0)
        q, k = wrapped(x)
        assert torch.equal(k, base(x)[1])


def test_groups_whose_slots_target_different_shards_share_a_step(make):
    """Slot 0 adapts k only, slot 1 q only: each group's rows get their own shard's delta and
    nothing on the other shard; a row of no adapter keeps the base output."""
    torch.manual_seed(2)
    base = MergedLinear(4, (6, 2), ("q_proj", "k_proj"), bias=False)
    nn.init.normal_(base.weight)
    wrapped = make(base, 4, base.output_sizes, max_loras=2, max_rank=3, device=CPU)
    ak, bk, aq, bq = torch.randn(2, 4), torch.randn(2, 2), torch.randn(3, 4), torch.randn(6, 3)
    wrapped.set_slot(0, 1, ak, bk, 0.5)
    wrapped.set_slot(1, 0, aq, bq, 2.0)
    x = torch.randn(4, 4)
    groups = (LoRAGroup(0, torch.tensor([0, 2])), LoRAGroup(1, torch.tensor([1])))
    with torch.no_grad(), set_lora_groups(groups, x.shape[0]):
        q, k = wrapped(x)
        q0, k0 = base(x)
    torch.testing.assert_close(k[[0, 2]], k0[[0, 2]] + _delta(x[[0, 2]], ak, bk, 0.5))
    torch.testing.assert_close(q[1], q0[1] + _delta(x[1:2], aq, bq, 2.0)[0])
    assert torch.equal(q[[0, 2]], q0[[0, 2]]) and torch.equal(k[1], k0[1])
    assert torch.equal(q[3], q0[3]) and torch.equal(k[3], k0[3])
