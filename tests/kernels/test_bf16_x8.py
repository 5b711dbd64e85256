"""bf16 weights regrouped eight rows at a time (csrc/x8_bf16.cpp): each SIMD variant is bit for bit
its own scalar model (same summation order), and the variants agree within the bf16 rounding of x.
The AMX tiles (variant amx, from 8 x rows on) match no scalar model's order: they are held to the
float64 product of the bf16-rounded x, and to giving a row the same bits in any batch.

vdpbf16ps takes x rounded to bf16 and flushes denormals, so it cannot equal the FMA variants
(float32 x) bit for bit; its scalar model (scalar_dp) rounds x the same way. The data here has no
denormals, so the flush does not show."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels unavailable")

CPU_FLAGS = open("/proc/cpuinfo").read()


def _has(flag: str) -> bool:
    return f" {flag} " in CPU_FLAGS or CPU_FLAGS.rstrip().endswith(f" {flag}")


VARIANTS = [("avx512bf16", "scalar_dp", "avx512_bf16"), ("avx512f", "scalar_fma", "avx512f"),
            ("avx2", "scalar_fma", "avx2")]


def _data(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g)
    return x, w


def test_pack_layout() -> None:
    """Byte 64q + 8r + 2v of group g holds w[8g + r][4q + v]."""
    _, w = _data(1, 16, 12)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    assert packed.shape == (2, 16 * 12)
    vals = packed.view(torch.bfloat16).view(2, 3, 8, 4)  # [group, quad, row, value]
    assert torch.equal(vals.permute(0, 2, 1, 3).reshape(16, 12), w)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("variant,model,feature", VARIANTS)
def test_variant_equals_its_scalar_model(m: int, variant: str, model: str, feature: str) -> None:
    if not _has(feature):
        pytest.skip(f"this CPU lacks {feature}")
    x, w = _data(m, 64, 256)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    got = torch.ops.pagedllm.bf16_linear_x8(x, packed, 256, variant)
    want = torch.ops.pagedllm.bf16_linear_x8(x, packed, 256, model)
    assert torch.equal(got, want)


@pytest.mark.skipif(not _has("avx512_bf16"), reason="this CPU lacks avx512_bf16")
@pytest.mark.parametrize("m,n,k", [(6, 32, 896), (7, 40, 64), (12, 24, 100), (37, 72, 896),
                                   (64, 136, 256), (130, 8, 4864)])
def test_avx512bf16_blocks_equal_their_scalar_model(m: int, n: int, k: int) -> None:
    """The kernels of 4 groups by 6 rows a block, with ragged groups and rows, at the prefill's
    row counts too: each row the scalar model's bits, and the same bits in any batch."""
    x, w = _data(m, n, k)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    full = torch.ops.pagedllm.bf16_linear_x8(x, packed, k, "avx512bf16")
    assert torch.equal(full, torch.ops.pagedllm.bf16_linear_x8(x, packed, k, "scalar_dp"))
    for lo, hi in ((0, 1), (1, min(m, 8)), (m // 2, m)):
        assert torch.equal(torch.ops.pagedllm.bf16_linear_x8(x[lo:hi], packed, k, "avx512bf16"), full[lo:hi])


def test_scalar_dp_model_is_exact_bf16_products() -> None:
    """bf16 x bf16 products are exact in float32, so plain float32 adds in the kernel's order
    (per row two lanes, odd element first, then lane 0 + lane 1) give scalar_dp's bits."""
    x, w = _data(2, 8, 64)
    xb = x.to(torch.bfloat16).float()
    wf = w.float()
    want = torch.empty(2, 8)
    for c in range(2):
        for r in range(8):
            acc = [torch.tensor(0.0), torch.tensor(0.0)]
            for q in range(16):
                for j in range(2):
                    for e in (1, 0):
                        i = 4 * q + 2 * j + e
                        acc[j] = acc[j] + wf[r, i] * xb[c, i]
            want[c, r] = acc[0] + acc[1]
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    assert torch.equal(torch.ops.pagedllm.bf16_linear_x8(x, packed, 64, "scalar_dp"), want)


def test_variants_agree_within_bf16_rounding_of_x() -> None:
    """Against float64 x @ W^T: FMA variants within float32 summation error; vdpbf16ps within
    the error of rounding x to bf16 (relative 2^-9 per value, ~sqrt(k) of it on the sum)."""
    x, w = _data(4, 64, 896)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    ref = x.double() @ w.double().t()
    scale = (x.double().abs() @ w.double().abs().t())  # sum |x w|: bound of the rounding error
    fma = torch.ops.pagedllm.bf16_linear_x8(x, packed, 896, "scalar_fma").double()
    dp = torch.ops.pagedllm.bf16_linear_x8(x, packed, 896, "scalar_dp").double()
    assert ((fma - ref).abs() <= scale * 896 * 2 ** -24).all()
    assert ((dp - ref).abs() <= scale * 2 ** -8).all()


def test_unknown_or_missing_variant_is_refused() -> None:
    _, w = _data(1, 8, 8)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    with pytest.raises(RuntimeError, match="unknown 'avx9'"):
        torch.ops.pagedllm.bf16_linear_x8(torch.zeros(1, 8), packed, 8, "avx9")
    with pytest.raises(RuntimeError, match="do not match k=16"):
        torch.ops.pagedllm.bf16_linear_x8(torch.zeros(1, 16), packed, 16, "scalar_fma")


AMX_MIN_ROWS = 8  # x8_bf16.cpp's kAmxMinRows


def _has_amx() -> bool:
    return all(_has(f) for f in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))


needs_amx = pytest.mark.skipif(not _has_amx(), reason="this CPU lacks amx_bf16 (or amx_tile, avx512_bf16)")


@needs_amx
@pytest.mark.parametrize("m,n,k", [(8, 64, 256), (13, 24, 100), (16, 16, 32), (37, 72, 896),
                                   (64, 128, 64), (65, 40, 4864), (200, 8, 36)])
def test_amx_tiles_give_the_product_of_the_bf16_x(m: int, n: int, k: int) -> None:
    """Whole tiles and ragged edges (rows past m, values past k, a lone 8-row group): the tiles'
    sums are within float32 summation error of x rounded to bf16 times W, in float64."""
    x, w = _data(m, n, k)
    got = torch.ops.pagedllm.bf16_linear_x8(x, torch.ops.pagedllm.bf16_pack_x8(w), k, "amx")
    ref = x.to(torch.bfloat16).double() @ w.double().t()
    scale = x.to(torch.bfloat16).double().abs() @ w.double().abs().t()
    assert ((got.double() - ref).abs() <= scale * k * 2 ** -24).all()


@needs_amx
def test_amx_gives_a_row_the_same_bits_in_any_batch() -> None:
    """Each x row runs the same tile sums whatever rows share its pass, and fewer than 8 rows take
    the vdpbf16ps kernels (their scalar model's bits)."""
    x, w = _data(70, 48, 320)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    full = torch.ops.pagedllm.bf16_linear_x8(x, packed, 320, "amx")
    for lo, hi in ((0, 8), (5, 30), (62, 70), (20, 68)):
        assert torch.equal(torch.ops.pagedllm.bf16_linear_x8(x[lo:hi], packed, 320, "amx"), full[lo:hi])
    few = x[:AMX_MIN_ROWS - 1]
    assert torch.equal(torch.ops.pagedllm.bf16_linear_x8(few, packed, 320, "amx"),
                       torch.ops.pagedllm.bf16_linear_x8(few, packed, 320, "scalar_dp"))


# --- as the engine runs them: ggml type BF16 through ggml_linear_x8, the chosen variant -------

BF16_TYPE = 30  # gguf.GGMLQuantizationType.BF16
CHOICES = ("amx", "avx512bf16", "avx512f", "avx2", "scalar")  # best first, as x8_bf16.cpp's kChoices
NEEDS = {"amx": "amx_bf16", "avx512bf16": "avx512_bf16", "avx512f": "avx512f", "avx2": "avx2"}


@pytest.fixture
def restore_variant():
    chosen = torch.ops.pagedllm.bf16_kernel()[0]
    yield
    torch.ops.pagedllm.set_bf16_kernel(chosen)


def test_auto_picks_the_best_runnable_variant() -> None:
    runnable = torch.ops.pagedllm.bf16_kernels()
    expect = [c for c in CHOICES if c == "scalar" or (c == "amx" and _has_amx()) or (
              c != "amx" and _has(NEEDS[c]) and _has("avx512f" if c == "avx512bf16" else NEEDS[c])
              and (c != "avx2" or _has("fma")))]
    assert runnable == expect
    out = subprocess.run([sys.executable, "-c", "import pagedllm.kernels as k; "
                          "print(k.bf16_kernel().name)"], capture_output=True, text=True,
                         env={**os.environ, "PAGEDLLM_BF16_KERNEL": "auto"})
    assert out.stdout.strip() == runnable[0], out.stderr


@pytest.mark.parametrize("variant", CHOICES)
def test_forcing_a_variant(variant: str, restore_variant) -> None:
    """Each variant this CPU runs can be forced; one it cannot is refused, naming the feature."""
    if variant in torch.ops.pagedllm.bf16_kernels():
        assert torch.ops.pagedllm.set_bf16_kernel(variant) == variant
        assert torch.ops.pagedllm.bf16_kernel()[0] == variant
        x, w = _data(3, 24, 64)
        packed = torch.ops.pagedllm.bf16_pack_x8(w)
        got = torch.ops.pagedllm.ggml_linear_x8(x, [packed], [BF16_TYPE], 64)[0]
        model = "scalar_dp" if variant in ("amx", "avx512bf16") else "scalar_fma"  # 3 rows: not tiles
        assert torch.equal(got, torch.ops.pagedllm.bf16_linear_x8(x, packed, 64, model))
    else:
        with pytest.raises(RuntimeError, match=f"bf16 kernels, but this machine lacks "
                                               f"(avx512f|avx512_bf16|amx_tile|{NEEDS[variant]})"):
            torch.ops.pagedllm.set_bf16_kernel(variant)


def test_an_unrunnable_env_choice_is_a_value_error() -> None:
    missing = [c for c in CHOICES if c not in torch.ops.pagedllm.bf16_kernels()]
    if not missing:
        pytest.skip("this CPU runs every bf16 variant")
    out = subprocess.run([sys.executable, "-c", "import pagedllm.kernels as k; k.load_kernels()"],
                         capture_output=True, text=True,
                         env={**os.environ, "PAGEDLLM_BF16_KERNEL": missing[0]})
    assert out.returncode != 0
    assert f"PAGEDLLM_BF16_KERNEL={missing[0]} asks for the {missing[0]} bf16 kernels" in out.stderr
    with pytest.raises(RuntimeError, match="unknown bf16 kernel variant 'avx9'"):
        torch.ops.pagedllm.set_bf16_kernel("avx9")


@pytest.mark.parametrize("m", [1, 7, 64, 130])
def test_several_weights_in_one_call(m: int) -> None:
    """q/k/v in one ggml_linear_x8 call equal each alone; from 64 rows on (prefill) the FMA
    variants widen W to float32 in chunks for a BLAS GEMM: exactly torch's mm on the float32
    values; the vdpbf16ps variants keep their own blocks (amx: its tiles from 8 rows on)."""
    x, w = _data(m, 40, 128)
    ws = [w[:16], w[16:24], w[24:]]
    packed = [torch.ops.pagedllm.bf16_pack_x8(t) for t in ws]
    outs = torch.ops.pagedllm.ggml_linear_x8(x, packed, [BF16_TYPE] * 3, 128)
    variant = torch.ops.pagedllm.bf16_kernel()[0]
    for got, p, t in zip(outs, packed, ws):
        if m >= 64 and variant not in ("amx", "avx512bf16"):
            assert torch.equal(got, torch.mm(x, t.float().t()))
        else:
            assert torch.equal(got, torch.ops.pagedllm.bf16_linear_x8(x, p, 128, variant))
    with pytest.raises(RuntimeError, match="cannot share a call with ggml type 8"):
        torch.ops.pagedllm.ggml_linear_x8(x, packed[:2], [BF16_TYPE, 8], 128)


def test_embed_and_unpack_give_the_checkpoint_values() -> None:
    _, w = _data(1, 32, 20)
    packed = torch.ops.pagedllm.bf16_pack_x8(w)
    assert torch.equal(torch.ops.pagedllm.bf16_unpack_x8(packed, 20), w)
    ids = torch.tensor([0, 31, 7, 8, 7])
    assert torch.equal(torch.ops.pagedllm.bf16_embed_x8(packed, ids, 20), w[ids].float())
    with pytest.raises(RuntimeError, match="token id 32 is outside the embedding's 32 rows"):
        torch.ops.pagedllm.bf16_embed_x8(packed, torch.tensor([32]), 20)


def _act(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    ops = torch.ops.pagedllm
    return ops.gelu_tanh_mul(gate, up) if gelu else ops.silu_mul(gate, up)


GATED_VARIANTS = [("avx512bf16", "avx512_bf16"), ("avx512f", "avx512f"), ("avx2", "avx2"),
                  ("scalar_dp", None), ("scalar_fma", None)]


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("variant,feature", GATED_VARIANTS)
def test_gated_is_the_act_of_the_two_matmuls(variant: str, feature: str, gelu: bool) -> None:
    """bf16_gated_x8 (the MLP's gate/up matmul with act applied as the vdpbf16ps blocks store,
    each block a pair of gate and up groups) is bit for bit silu_mul / gelu_tanh_mul of the
    variant's two matmuls: ragged rows, an odd number of 8-row groups (a last block of one gate
    and one up group), and the decode and prefill row counts."""
    if feature is not None and not _has(feature):
        pytest.skip(f"this CPU lacks {feature}")
    ops = torch.ops.pagedllm
    for m, n, k in ((1, 40, 256), (5, 64, 96), (6, 72, 896), (7, 8, 64), (32, 136, 256),
                    (130, 40, 100)):
        x, gate = _data(m, n, k)
        _, up = _data(m + 1, n, k)
        gp, up_p = ops.bf16_pack_x8(gate), ops.bf16_pack_x8(up)
        want = _act(ops.bf16_linear_x8(x, gp, k, variant), ops.bf16_linear_x8(x, up_p, k, variant), gelu)
        got = ops.bf16_gated_x8(x, gp, up_p, k, gelu, False, variant)
        assert torch.equal(got, want), (m, n, k)
        # bf16_out: the vdpbf16ps blocks store the values rounded to bf16 (torch's rounding);
        # the next matmul takes them as they are and gives what it gives on the float32 values.
        # The other variants return float32.
        short = ops.bf16_gated_x8(x, gp, up_p, k, gelu, True, variant)
        if variant == "avx512bf16":
            assert short.dtype == torch.bfloat16 and torch.equal(short, want.to(torch.bfloat16))
            _, down = _data(m + 2, 16, n)
            dp = ops.bf16_pack_x8(down)
            assert torch.equal(ops.bf16_linear_x8(short, dp, n, variant),
                               ops.bf16_linear_x8(want, dp, n, variant))
        else:
            assert torch.equal(short, want)
    assert ops.bf16_gated_x8(x[:0], gp, up_p, k, gelu, False, variant).shape == (0, n)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_ggml_gated_x8_takes_the_active_variant_and_checks_its_inputs(gelu: bool) -> None:
    ops = torch.ops.pagedllm
    x, gate = _data(9, 48, 128)
    _, up = _data(10, 48, 128)
    gp, up_p = ops.bf16_pack_x8(gate), ops.bf16_pack_x8(up)
    got = ops.ggml_gated_x8(x, [gp, up_p], [BF16_TYPE] * 2, 128, gelu)
    assert torch.equal(got, _act(*ops.ggml_linear_x8(x, [gp, up_p], [BF16_TYPE] * 2, 128), gelu))
    with pytest.raises(RuntimeError, match="gate and up must have the same shape"):
        ops.ggml_gated_x8(x, [gp, up_p[:2]], [BF16_TYPE] * 2, 128, gelu)
    with pytest.raises(RuntimeError, match="need a gate and an up weight"):
        ops.ggml_gated_x8(x, [gp], [BF16_TYPE], 128, gelu)
