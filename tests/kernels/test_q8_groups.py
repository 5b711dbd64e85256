"""The grouped Q8_0 type (kernels/types.py: Q8_0G4): Q8_0 blocks whose groups of 4 blocks share
one scale, against x quantized with one scale per group of 128 values. Every instruction-set
variant this machine runs gives the AVX2 variant's numbers bit for bit at every batch size (the
AMX-INT8 pass from 32 rows among them), and the exact products of the group-quantized x and the
weights within float32 rounding; a row whose block count is not a multiple of 4 ends with a shorter
group; a call cannot mix it with the per-block types (their x is quantized otherwise)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from pagedllm.kernels.types import Q8_0G4, Q8_GROUP_BLOCKS

from test_ggml_kernels import random_blocks
from test_isa_variants import SIMD_VARIANTS as VARIANTS  # each against avx2
from test_isa_variants import _use, restore_variant  # noqa: F401 (an autouse fixture)

ops = torch.ops.pagedllm
# gemv tiles (1-7 rows), the gemm from 8 rows in chunks of 64, the AMX passes of 16 and 32 rows
ROWS = (1, 2, 3, 4, 7, 8, 9, 16, 17, 31, 32, 33, 48, 64, 65, 100, 130)


def grouped_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    """Random Q8_0 blocks [rows, k / 32 * 34], each group's scale copied into its blocks; every
    weight of row 0 at -128 and of row 9 at 127."""
    raw = random_blocks(T.Q8_0, rows, k, seed=seed).reshape(rows, k // 32, 34)
    for b in range(k // 32):
        raw[:, b, :2] = raw[:, b - b % Q8_GROUP_BLOCKS, :2]
    raw[0, :, 2:] = 0x80
    raw[9, :, 2:] = 0x7F
    return raw.reshape(rows, -1)


def exact(x: torch.Tensor, raw: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [m, n]: x quantized as the kernels do (per group of 4 blocks: d = max|x| / 127 in
    float32, q = x * (1 / d) rounded half to even) times the weights, exactly; and the sum of the
    products' magnitudes (the float32 rounding's scale)."""
    g = 32 * Q8_GROUP_BLOCKS
    xf = x.float().numpy()
    q = np.zeros_like(xf)
    dx = np.zeros_like(xf)
    for s in range(0, k, g):
        part = xf[:, s:s + g]
        d = (np.abs(part).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q[:, s:s + g] = np.rint((part * inv).astype(np.float32))
        dx[:, s:s + g] = d
    w = torch.from_numpy(gguf_dequantize(raw, T.Q8_0).reshape(raw.shape[0], k)).double()
    xq = torch.from_numpy(q * dx.astype(np.float64)).double()
    return xq @ w.t(), xq.abs() @ w.abs().t()


@pytest.mark.parametrize("k", [896, 576], ids=["7 groups", "18 blocks: a last group of 2"])
def test_every_variant_gives_avx2_numbers_and_the_exact_products(k):
    raw = grouped_blocks(40, k, seed=21)
    packed = ops.ggml_pack_x8(torch.from_numpy(raw), Q8_0G4, k)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(4))
    x[5] = -1.0
    x[6, :100] *= 50  # one group's scale far above the others'
    ref, scale = exact(x, raw, k)
    _use("avx2")
    expected = {m: ops.ggml_linear_x8(x[:m], [packed], [Q8_0G4], k)[0] for m in ROWS}
    for m in ROWS:
        err = (expected[m].double() - ref[:m]).abs()
        assert (err <= 1e-5 * scale[:m] + 1e-30).all(), f"avx2 at {m} rows: {(err / scale[:m]).max():.2e}"
        assert torch.equal(expected[m], expected[130][:m]), f"avx2: other bits at {m} rows than in 130"
    for variant in VARIANTS:
        try:
            ops.set_kernel_isa(variant)
        except RuntimeError:
            continue  # this machine cannot run it (test_isa_variants.py names the missing feature)
        for m in ROWS:
            y = ops.ggml_linear_x8(x[:m], [packed], [Q8_0G4], k)[0]
            assert torch.equal(y, expected[m]), f"{variant} differs from avx2 at {m} rows"


def test_two_matrices_in_one_call_and_a_lone_group():
    """gate and up as the model runs them: two matrices in one call, the AMX pass over group pairs
    and a lone 8-row group (24 rows: three groups)."""
    k = 896
    a, b = grouped_blocks(48, k, seed=22), grouped_blocks(24, k, seed=23)
    pa, pb = (ops.ggml_pack_x8(torch.from_numpy(r), Q8_0G4, k) for r in (a, b))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(5))
    for m in (1, 8, 33, 70):
        ya, yb = ops.ggml_linear_x8(x[:m], [pa, pb], [Q8_0G4, Q8_0G4], k)
        for y, raw in ((ya, a), (yb, b)):
            ref, scale = exact(x[:m], raw, k)
            assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all(), f"{m} rows"


def test_dequantization_and_embedding_are_q8_0s():
    k = 576
    raw = grouped_blocks(16, k, seed=24)
    packed = ops.ggml_pack_x8(torch.from_numpy(raw), Q8_0G4, k)
    want = torch.from_numpy(gguf_dequantize(raw, T.Q8_0).reshape(16, k))
    assert torch.equal(ops.ggml_dequant_x8(packed, Q8_0G4, k), want)
    assert torch.equal(ops.ggml_embed_x8(packed, torch.tensor([3, 0, 15]), Q8_0G4, k), want[[3, 0, 15]])


def test_a_call_mixing_it_with_per_block_types_is_refused():
    k = 512
    g = ops.ggml_pack_x8(torch.from_numpy(grouped_blocks(16, k, seed=25)), Q8_0G4, k)
    q = ops.ggml_pack_x8(torch.from_numpy(random_blocks(T.Q8_0, 16, k, seed=26)), int(T.Q8_0), k)
    _use("avx2")
    with pytest.raises(RuntimeError, match="cannot share an x8 call"):
        ops.ggml_linear_x8(torch.randn(2, k), [q, g], [int(T.Q8_0), Q8_0G4], k)


def test_the_quantizer_at_load_shares_each_groups_scale():
    """layers/quantization.py's quantize_q8_0g4 (quantization="int8_g128"): every block of a group
    carries the scale max|w| / 127 of its 128 values, each value within half a step of w; a row of
    no multiple of 128 values is refused."""
    from pagedllm.layers.quantization import quantize_q8_0g4

    w = torch.randn(16, 384, generator=torch.Generator().manual_seed(6))
    w[3, 130] = 40.0  # one value far above its group's others
    raw = quantize_q8_0g4(w).numpy().reshape(16, 12, 34)
    d = raw[:, :, :2].copy().view(np.float16).reshape(16, 12).astype(np.float32)
    assert (d.reshape(16, 3, 4) == d.reshape(16, 3, 4)[:, :, :1]).all()
    assert np.allclose(d[:, ::4], w.abs().reshape(16, 3, 128).amax(-1).numpy() / 127, rtol=1e-3)
    back = torch.from_numpy(gguf_dequantize(raw.reshape(16, -1), T.Q8_0).reshape(16, 384))
    step = torch.from_numpy(np.repeat(d, 32, axis=1))
    assert ((back - w).abs() <= step * 0.5 + 1e-3 * step).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_q8_0g4(torch.randn(4, 576))
