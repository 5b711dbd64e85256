"""The greedy head screen (csrc/head_screen.cpp): the token of every row is the argmax of the bf16
head's logits as linear_x8 computes them, under every bf16 variant this CPU runs (forced in
turn), including where the int8 pass alone would pick another id; -1 where it does not decide."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import bf16_kernel, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels unavailable")

ops = torch.ops.pagedllm
BF16, Q8_0 = 30, 8
K = 128


def _head(v: int, seed: int, pairs: bool = False) -> torch.Tensor:
    """bf16 [v, K]; pairs: row 2i + 1 is row 2i with 3 values one bf16 step larger in
    magnitude, so that the int8 copy holds both alike (their int8 logits tie) while the bf16
    logits of an x along them put row 2i + 1 first."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, K, generator=gen) * 0.05).bfloat16()
    if pairs:
        odd = w[0::2].clone()
        cols = torch.randint(0, K, (v // 2, 3), generator=gen)
        for r in range(v // 2):
            for c in cols[r].tolist():
                v = odd[r, c].float()
                odd[r, c] = (v + v.sign() * v.abs() * 2 ** -7).bfloat16()  # one bf16 step out
        w[1::2] = odd
    return w


def _x(m: int, seed: int) -> torch.Tensor:
    """Hidden states like a final norm's: mostly unit-sized, a few large dimensions."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen)
    x[:, 7] *= 30
    x[:, 77] *= 12
    return x


def _full(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    return ops.argmax_rows(ops.ggml_linear_x8(x, [wp], [BF16], K)[0])


@pytest.fixture(params=bf16_kernel().runnable if kernels_available() else [])
def variant(request):
    """Each bf16 variant this CPU runs, active for the test (restored after)."""
    chosen = bf16_kernel().name
    ops.set_bf16_kernel(request.param)
    yield request.param
    ops.set_bf16_kernel(chosen)


def _screen(w: torch.Tensor):
    wp = ops.bf16_pack_x8(w)
    wq, norms = ops.bf16_head_q8_copy(wp, K)
    return wp, wq, norms


@pytest.mark.parametrize("m", [1, 5, 32])
def test_tokens_are_the_full_heads_argmax(variant, m):
    wp, wq, norms = _screen(_head(1024, seed=1))
    for seed in range(4):
        x = _x(m, seed)
        got = ops.bf16_head_argmax(x, wp, wq, norms, K)
        if variant == "amx" and m >= 8:  # the tiles' rows depend on the batch: not decided
            assert (got == -1).all()
            continue
        assert torch.equal(got, _full(x, wp)), variant


def test_ids_the_int8_pass_cannot_tell_apart_take_the_bf16_logits(variant):
    """Pairs of rows one bf16 step apart: the int8 logits tie (or order them wrongly) for many
    rows, and the screen still gives the bf16 argmax."""
    wp, wq, norms = _screen(_head(512, seed=2, pairs=True))
    x = _x(7, 5)
    x = torch.cat([x, 3 * ops.bf16_unpack_x8(wp, K)[100:107].float()])  # rows aimed at pairs
    got = ops.bf16_head_argmax(x, wp, wq, norms, K)
    full = _full(x, wp)
    int8 = ops.argmax_rows(ops.ggml_linear_x8(x, [wq], [Q8_0], K)[0])
    assert (int8 != full).any(), "the case must defeat the int8 pass alone"
    if variant == "amx":
        assert (got == -1).all()
        return
    assert torch.equal(got, full)


def test_equal_logits_give_the_first_id(variant):
    w = _head(256, seed=3)
    w[41] = w[40]
    w[200] = w[40]
    wp, wq, norms = _screen(w)
    x = 4 * w[40:41].float()
    assert ops.bf16_head_argmax(x, wp, wq, norms, K).tolist() == [40] == _full(x, wp).tolist()


def test_rows_not_finite_are_left_to_the_full_head():
    wp, wq, norms = _screen(_head(256, seed=4))
    x = _x(4, 1)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    got = ops.bf16_head_argmax(x, wp, wq, norms, K)
    assert got[1] == -1 and got[2] == -1
    assert got[[0, 3]].tolist() == _full(x[[0, 3]], wp).tolist()


def test_float32_x_variants_leave_the_blas_batches_undecided():
    """From 64 rows the float32-x variants take a BLAS GEMM, whose rows need not have the bits
    of one row alone: the screen leaves such a batch to the full head."""
    fma = [v for v in bf16_kernel().runnable if v not in ("amx", "avx512bf16")]
    chosen = bf16_kernel().name
    wp, wq, norms = _screen(_head(256, seed=5))
    try:
        ops.set_bf16_kernel(fma[0])
        assert (ops.bf16_head_argmax(_x(64, 2), wp, wq, norms, K) == -1).all()
        assert (ops.bf16_head_argmax(_x(63, 2), wp, wq, norms, K) >= 0).all()
    finally:
        ops.set_bf16_kernel(chosen)


def test_the_copy_and_its_norms():
    """The Q8_0 copy is within half a step of each value, and the norms are those of the values
    held (float64, rounded up to float32)."""
    w = _head(512, seed=6)
    wp, wq, norms = _screen(w)
    wt = ops.ggml_dequant_x8(wq, Q8_0, K).double()  # [512, K]
    wd = w.double()
    d = wt.abs().view(512, K // 32, 32).amax(-1) / 127
    assert ((wd - wt).abs().view(512, K // 32, 32) <= 0.51 * d.unsqueeze(-1) + 1e-12).all()
    for got, ref in zip(norms.double(), (wd.norm(dim=1), (wd - wt).norm(dim=1), wt.norm(dim=1))):
        assert (got >= ref).all() and (got <= ref * (1 + 2 ** -22)).all()


def test_bad_inputs_name_what_is_wrong():
    wp, wq, norms = _screen(_head(256, seed=7))
    with pytest.raises(RuntimeError, match="norms"):
        ops.bf16_head_argmax(_x(2, 0), wp, wq, norms[:, :8].contiguous(), K)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.bf16_head_argmax(_x(2, 0)[:, :64], wp, wq, norms, K)
    with pytest.raises(RuntimeError, match="groups"):
        ops.bf16_head_argmax(_x(2, 0), wp, wq[:4], norms, K)
    with pytest.raises(RuntimeError, match="w must be a bf16 x8 weight"):
        ops.bf16_head_argmax(_x(2, 0), wq, wq, norms, K)


@pytest.mark.parametrize("isa", torch.ops.pagedllm.kernel_isas() if kernels_available() else [])
def test_every_int8_variant_screens_alike(isa):
    """The int8 pass runs the x8 variant the process chose (forced here in turn): each gives the
    bf16 argmax; the generic one (no integer kernels) leaves every row to the full head."""
    before = ops.kernel_isa()[0]
    wp, wq, norms = _screen(_head(1024, seed=8, pairs=True))
    x = _x(20, 3)
    try:
        ops.set_kernel_isa(isa)
        got = ops.bf16_head_argmax(x, wp, wq, norms, K)
    finally:
        ops.set_kernel_isa(before)
    if isa == "generic":
        assert (got == -1).all()
    elif bf16_kernel().name == "amx":
        assert (got == -1).all()  # 20 rows on the bf16 tiles
    else:
        assert torch.equal(got, _full(x, wp))


def test_a_step_too_large_for_rows_alone_is_left_to_the_full_head():
    """step_rows: the rows of the step's full head call, of which x holds some. Under a float32-x
    variant a 64-row call takes BLAS, so even 3 rows of such a step are not decided."""
    fma = [v for v in bf16_kernel().runnable if v not in ("amx", "avx512bf16")]
    chosen = bf16_kernel().name
    wp, wq, norms = _screen(_head(256, seed=9))
    x = _x(3, 4)
    try:
        ops.set_bf16_kernel(fma[0])
        assert (ops.bf16_head_argmax(x, wp, wq, norms, K, 64) == -1).all()
        assert torch.equal(ops.bf16_head_argmax(x, wp, wq, norms, K, 63), _full(x, wp))
        with pytest.raises(RuntimeError, match="step_rows"):
            ops.bf16_head_argmax(x, wp, wq, norms, K, 2)
    finally:
        ops.set_bf16_kernel(chosen)
