"""ops.sample_rows (kernels/csrc/sampling.cpp), the CPU sampler's random rows: the same kept set
as a float64 reference of the full path's filters (min-p, top-k, top-p), and the inverse CDF in
id order at the given u."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import kernels_available, load_kernels
from pagedllm.sample import ops

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels unavailable")

V = 20000  # wide enough for top-p's bucketed edge (> 8,192 candidates) and top-k's nth_element


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernels()


def reference(logits: torch.Tensor, t: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """The full path's distribution in float64: softmax(z / t), min-p, then top-k (ties at the
    k-th kept), then the smallest nucleus of mass >= p of what is left (ties at its edge kept)."""
    z = logits.double() / t
    probs = torch.softmax(z, -1)
    keep = probs >= min_p * probs.max()
    if k < logits.numel():
        kth = torch.where(keep, z, float("-inf")).topk(k).values[-1]
        keep &= z >= kth
    if p < 1.0:
        q = torch.where(keep, probs, 0.0)
        q = q / q.sum()
        vals = q.sort(descending=True).values
        edge = vals[int((vals.cumsum(0) < p).sum())]
        keep &= q >= edge
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def draw(logits: torch.Tensor, t: float, k: int, p: float, min_p: float,
         u: torch.Tensor) -> torch.Tensor:
    """One draw of the row logits per value of u, 1,000 rows a call."""
    out = []
    for part in u.split(1000):
        n = part.numel()
        out.append(ops.sample_rows(logits.expand(n, -1).contiguous(), torch.full((n,), t),
                                   torch.full((n,), k, dtype=torch.long), torch.full((n,), p),
                                   torch.full((n,), min_p), part))
    return torch.cat(out)


LOGITS = {  # a chat model's shape (a few ids far ahead) and two flat ones (wide nuclei)
    "peaked": lambda g: (torch.randn(V, generator=g) * 3).index_fill_(0, torch.arange(0, 900, 37), 16.0),
    "flat": lambda g: torch.randn(V, generator=g) * 3,
    "flatter": lambda g: torch.randn(V, generator=g),
}
FILTERS = [(1.0, V, 1.0, 0.0), (0.8, V, 0.95, 0.0), (1.0, V, 0.5, 0.0), (0.7, 20, 0.8, 0.0),
           (1.0, 3000, 1.0, 0.0), (1.0, 6000, 0.9, 0.0), (1.3, V, 1.0, 0.001)]


@pytest.mark.parametrize("t,k,p,min_p", FILTERS)
@pytest.mark.parametrize("shape", sorted(LOGITS))
def test_the_kept_set_and_its_edge_are_the_references(shape, t, k, p, min_p):
    """8,000 draws (seeded u): none outside the reference's kept ids, and the kept ids' least
    likely fifth (where a wrong edge would show) drawn as often as its mass says (within 4.5
    standard deviations). Covers the heap (k <= 4,096) and nth_element top-k, and top-p's sorted
    and bucketed edges (wider than 8,192 candidates: "flatter")."""
    g = torch.Generator().manual_seed(7)
    logits = LOGITS[shape](g)
    want = reference(logits, t, k, p, min_p)
    n = 8000
    got = draw(logits, t, k, p, min_p, torch.rand(n, generator=g, dtype=torch.float64))
    assert bool((want[got] > 0).all())
    kept = (want > 0).nonzero().flatten()
    if kept.numel() >= 10:
        low = kept[want[kept].argsort()][: kept.numel() // 5]
        mass = want[low].sum().item()
        share = torch.isin(got, low).double().mean().item()
        assert abs(share - mass) <= 4.5 * (mass * (1 - mass) / n) ** 0.5 + 1e-4, (share, mass)


def test_the_draw_inverts_the_cdf_in_id_order():
    """u away from the CDF's steps picks the id the float64 reference's CDF gives."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1000, generator=g) * 2
    logits[::7] = float("-inf")  # banned ids: probability 0, never drawn
    probs = reference(logits, 0.9, 1000, 1.0, 0.0)
    cdf = probs.cumsum(0)
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    near_step = (cdf.unsqueeze(0) - u.unsqueeze(1)).abs().min(dim=1).values < 1e-6
    u = u[~near_step]
    got = draw(logits, 0.9, 1000, 1.0, 0.0, u)
    assert torch.equal(got, torch.searchsorted(cdf, u, right=True))
    assert bool((got % 7 != 0).all())


def test_rows_are_independent_and_not_finite_rows_get_minus_one():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5000, generator=g)
    logits[1, 10] = float("nan")
    logits[2] = float("-inf")  # every id banned
    logits[3, 99] = float("inf")
    u = torch.rand(4, generator=g, dtype=torch.float64)
    got = ops.sample_rows(logits, torch.ones(4), None, None, None, u).tolist()
    assert got[1:] == [-1, -1, -1]
    alone = ops.sample_rows(logits[:1], torch.ones(1), None, None, None, u[:1]).item()
    assert got[0] == alone and 0 <= alone < 5000


def test_bad_arguments_name_what_is_wrong():
    logits = torch.randn(2, 100)
    u = torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="temperature must be > 0 for a random row"):
        ops.sample_rows(logits, torch.tensor([1.0, 0.0]), None, None, None, u)
    with pytest.raises(RuntimeError, match=r"top_p must hold one value per row \(2\)"):
        ops.sample_rows(logits, torch.ones(2), None, torch.ones(3), None, u)
