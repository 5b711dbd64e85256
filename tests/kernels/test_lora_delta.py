"""lora_add_ (kernels/csrc/lora_delta.cpp): every shard's LoRA delta by each row's slot, against
float64 PyTorch; a row gets the same bits alone as in a step of other slots; bad tables are
refused by name."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import kernels_loaded, load_kernels

IN, OUTS, SLOTS, RANK = 576, (576, 192, 192), 4, 8  # SmolLM2's q/k/v at rank 8


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernels()
    if not kernels_loaded():
        pytest.skip("no compiled CPU kernels")


def _tables(seed: int = 0):
    """a, bts and ranks of four slots: full rank on every shard, rank 3 on q and v, rank 1 on k
    only, and an empty slot."""
    g = torch.Generator().manual_seed(seed)
    shards = len(OUTS)
    a = torch.zeros(SLOTS, shards * RANK, IN)
    bts = [torch.zeros(SLOTS, RANK, n) for n in OUTS]
    ranks = torch.tensor([[8, 8, 8], [3, 0, 3], [0, 1, 0], [0, 0, 0]])
    for s in range(SLOTS):
        for i in range(shards):
            r = int(ranks[s, i])
            a[s, i * RANK:i * RANK + r] = torch.randn(r, IN, generator=g) * 0.05
            bts[i][s, :r] = torch.randn(r, OUTS[i], generator=g) * 0.05
    return a, bts, ranks


def _want(ys, x, slots, a, bts, ranks):
    out = [y.double().clone() for y in ys]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i, bt in enumerate(bts):
            r = int(ranks[s, i])
            h = x[t].double() @ a[s, i * RANK:i * RANK + r].double().t()
            out[i][t] += h @ bt[s, :r].double()
    return out


def test_each_row_gets_its_slots_delta_on_every_shard():
    a, bts, ranks = _tables()
    x = torch.randn(9, IN)
    slots = torch.tensor([0, -1, 1, 2, 3, 0, 2, -1, 1])
    base = [torch.randn(9, n) for n in OUTS]
    ys = [y.clone() for y in base]
    torch.ops.pagedllm.lora_add_(ys, x, slots, a, bts, ranks)
    for y, want in zip(ys, _want(base, x, slots, a, bts, ranks)):
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    # rows of no slot, of an empty slot, and shards a slot leaves alone: untouched bits
    for t in (1, 4, 7):
        assert all(torch.equal(y[t], y0[t]) for y, y0 in zip(ys, base))
    assert torch.equal(ys[1][2], base[1][2]) and torch.equal(ys[0][3], base[0][3])


def test_a_row_gets_the_same_bits_alone_as_in_a_mixed_step_and_in_column_views():
    a, bts, ranks = _tables(1)
    x = torch.randn(16, IN)
    slots = torch.tensor([i % 3 for i in range(16)])
    merged = torch.randn(16, sum(OUTS))  # the shards as column views of one output
    ys = list(merged.split(OUTS, dim=1))
    before = merged.clone()
    torch.ops.pagedllm.lora_add_(ys, x, slots, a, bts, ranks)
    for t in range(16):
        alone = [y.clone() for y in before[t:t + 1].split(OUTS, dim=1)]
        torch.ops.pagedllm.lora_add_(alone, x[t:t + 1], slots[t:t + 1], a, bts, ranks)
        assert torch.equal(torch.cat(alone, 1)[0], merged[t]), t


def test_bad_slots_ranks_and_shapes_are_refused_by_name():
    a, bts, ranks = _tables()
    x, ys, two = torch.randn(2, IN), [torch.zeros(2, n) for n in OUTS], torch.tensor([0, 1])
    add = torch.ops.pagedllm.lora_add_
    with pytest.raises(RuntimeError, match="slots must be -1 or below 4, got 4"):
        add(ys, x, torch.tensor([0, 4]), a, bts, ranks)
    with pytest.raises(RuntimeError, match="ranks must be in \\[0, 8\\], got 9"):
        add(ys, x, two, a, bts, torch.where(ranks == 8, 9, ranks))
    with pytest.raises(RuntimeError, match="bts\\[1\\] must be \\[4, 8, 192\\]"):
        add(ys, x, two, a, [bts[0], bts[0], bts[2]], ranks)
    with pytest.raises(RuntimeError, match="one slot \\(or -1\\) per row of x"):
        add(ys, x, torch.tensor([0]), a, bts, ranks)


def test_ranks_over_eight_take_several_blocks():
    """max_lora_rank 16, an adapter of rank 12 (a block of 8, then one of 4) on two odd widths:
    float64's numbers, and a row's bits alone as in the step."""
    g = torch.Generator().manual_seed(2)
    a = torch.zeros(2, 32, 37)
    a[1, :12], a[1, 16:28] = torch.randn(12, 37, generator=g), torch.randn(12, 37, generator=g)
    bts = [torch.zeros(2, 16, 21), torch.zeros(2, 16, 9)]
    bts[0][1, :12] = torch.randn(12, 21, generator=g)
    bts[1][1, :12] = torch.randn(12, 9, generator=g)
    ranks = torch.tensor([[0, 0], [12, 12]])
    x, slots = torch.randn(5, 37, generator=g), torch.tensor([1, -1, 1, 1, 0])
    base = [torch.randn(5, 21), torch.randn(5, 9)]
    ys = [y.clone() for y in base]
    torch.ops.pagedllm.lora_add_(ys, x, slots, a, bts, ranks)
    for i, (y, y0) in enumerate(zip(ys, base)):
        want = y0.double().clone()
        want[[0, 2, 3]] += (x[[0, 2, 3]].double() @ a[1, 16 * i:16 * i + 12].double().t()
                            ) @ bts[i][1, :12].double()
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    alone = [y0[2:3].clone() for y0 in base]
    torch.ops.pagedllm.lora_add_(alone, x[2:3], slots[2:3], a, bts, ranks)
    assert all(torch.equal(y1[0], y[2]) for y1, y in zip(alone, ys))
