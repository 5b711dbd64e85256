"""The eight-row (x8) layout: lossless against the GGUF blocks, and its kernels against
gguf-py's dequantization followed by a float64 matmul, on random and real tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from pagedllm.kernels import load_kernels
from pagedllm.layers.ggml_linear import (KERNEL_TYPES, X8_TYPES, GGMLEmbedding, GGMLLinear,
                                         GGMLMergedLinear, pack_x8)

from test_ggml_kernels import _real_tensors, random_blocks, rel_error

ops = torch.ops.pagedllm


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernels()


@pytest.mark.parametrize("qtype", sorted(X8_TYPES), ids=lambda t: t.name)
def test_packing_is_lossless_and_dequantizes_exactly(qtype):
    raw = torch.from_numpy(random_blocks(qtype, 24, 512, seed=3))
    packed = ops.ggml_pack_x8(raw, int(qtype), 512)
    # at most 4 % more: the unpacked 6-bit scales of Q4_K, Q5_K (2-3 %) and Q3_K (3.6 %)
    assert packed.shape[0] == 3 and packed.numel() <= raw.numel() * 1.04
    assert torch.equal(ops.ggml_unpack_x8(packed, int(qtype), 512), raw)
    ref = gguf_dequantize(raw.numpy(), qtype).reshape(24, 512)
    np.testing.assert_array_equal(ops.ggml_dequant_x8(packed, int(qtype), 512).numpy(), ref)
    ids = torch.tensor([23, 0, 9, 9])
    np.testing.assert_array_equal(ops.ggml_embed_x8(packed, ids, int(qtype), 512).numpy(),
                                  ref[ids.numpy()])


@pytest.mark.parametrize("qtype", sorted(X8_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 70])  # gemv tiles of 4, 2 and 1; the gemm from 8, chunks of 64
def test_linear_matches_dequantize_then_matmul(qtype, m):
    raw = torch.from_numpy(random_blocks(qtype, 40, 768, seed=m))
    w = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(40, 768)).double()
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    packed = ops.ggml_pack_x8(raw, int(qtype), 768)
    y = ops.ggml_linear_x8(x, [packed], [int(qtype)], 768)[0]
    # x is quantized to int8 per 32 values, as llama.cpp does: ~0.5 % relative error
    assert rel_error(y, x.double() @ w.t()) < 0.02
    # a row of x alone gives the very same numbers as in the batch (batch-invariant), whichever
    # kernel and chunk the batch used
    for i in sorted({0, m - 1, min(64, m - 1)}):
        assert torch.equal(ops.ggml_linear_x8(x[i:i + 1], [packed], [int(qtype)], 768)[0], y[i:i + 1])


def test_q8_0_rows_in_a_gemm_batch_equal_each_row_alone():
    """Q8_0's gemm (8+ rows) gives every row the numbers of the gemv (that row alone) bit for bit,
    in each integer variant this CPU runs, also at the extremes: weights -128 and 127, x at +-127
    (avx512amx_bf16, asked for only, leaves the integers on purpose: test_isa_variants.py)."""
    k = 256
    raw = random_blocks(T.Q8_0, 16, k, seed=7).reshape(16, k // 32, 34)
    raw[0, :, 2:] = np.uint8(0x80)  # every weight of row 0 is -128
    raw[1, :, 2:] = np.uint8(0x7F)  # and of row 1, 127
    packed = ops.ggml_pack_x8(torch.from_numpy(raw.reshape(16, -1)), int(T.Q8_0), k)
    x = torch.randn(65, k, generator=torch.Generator().manual_seed(2))
    x[3] = -1.0  # each block of x quantizes to -127 throughout
    x[4, ::32] = 100.0  # one +127 per block, the rest small
    before = ops.kernel_isa()[0]
    try:
        for variant in (v for v in ops.kernel_isas() if v not in ("generic", "avx512amx_bf16")):
            ops.set_kernel_isa(variant)
            alone = torch.cat([ops.ggml_linear_x8(x[i:i + 1], [packed], [int(T.Q8_0)], k)[0] for i in range(65)])
            for m in (8, 9, 33, 64, 65):
                y = ops.ggml_linear_x8(x[:m], [packed], [int(T.Q8_0)], k)[0]
                assert torch.equal(y, alone[:m]), f"{variant}: the gemm at {m} rows differs from the gemv"
    finally:
        ops.set_kernel_isa(before)


def test_several_weights_in_one_call():
    raws = [torch.from_numpy(random_blocks(t, 16, 256, seed=i))
            for i, t in enumerate((T.Q5_0, T.Q8_0, T.Q4_K))]
    types = [int(t) for t in (T.Q5_0, T.Q8_0, T.Q4_K)]
    packed = [ops.ggml_pack_x8(r, t, 256) for r, t in zip(raws, types)]
    x = torch.randn(3, 256)
    for y, p, t in zip(ops.ggml_linear_x8(x, packed, types, 256), packed, types):
        torch.testing.assert_close(y, ops.ggml_linear_x8(x, [p], [t], 256)[0])


def test_pack_x8_keeps_tied_weights_shared_and_skips_rows_not_a_multiple_of_8():
    raw = torch.from_numpy(random_blocks(T.Q8_0, 48, 64))
    emb, head = GGMLEmbedding(48, 64, T.Q8_0), GGMLLinear(64, 48, T.Q8_0, bias=False)
    emb.weight.data = raw
    head.weight = emb.weight  # tied
    odd = GGMLLinear(64, 12, T.Q4_0, bias=True)  # 12 rows: not a multiple of 8
    odd.weight.data = torch.from_numpy(random_blocks(T.Q4_0, 12, 64))
    model = nn.ModuleDict({"emb": emb, "head": head, "odd": odd})
    x, ids = torch.randn(2, 64), torch.tensor([5, 47])
    before = (head(x), emb(ids), odd(x))
    assert pack_x8(model) == 1
    assert emb.packed and head.packed and emb.weight is head.weight
    assert not odd.packed
    assert rel_error(head(x), before[0]) < 0.02
    torch.testing.assert_close(emb(ids), before[1], rtol=0, atol=0)
    assert pack_x8(model) == 0  # packing twice is a no-op


def test_merged_block_linear_runs_its_shards_in_one_call_with_their_own_types():
    types = (T.Q5_0, T.Q6_K, T.Q8_0)  # a Q4_K_M file mixes types within q/k/v
    sizes = (16, 8, 8)
    merged = GGMLMergedLinear(256, sizes, ("q_proj", "k_proj", "v_proj"), types, bias=True,
                              dtype=torch.float32)
    raws = [torch.from_numpy(random_blocks(t, n, 256)) for t, n in zip(types, sizes)]
    for w, raw in zip(merged.weights, raws):
        w.data = raw
    merged.bias.data = torch.randn(sum(sizes))
    shards = merged.shard_tensors()
    assert shards["k_proj.weight"] is merged.weights[1]
    assert torch.equal(shards["v_proj.bias"], merged.bias[24:])
    x = torch.randn(3, 256)
    before = merged(x)
    refs = [x.double() @ torch.from_numpy(gguf_dequantize(raw.numpy(), t).reshape(n, 256)).double().t()
            for raw, t, n in zip(raws, types, sizes)]
    assert pack_x8(nn.ModuleDict({"m": merged})) == 3 and merged.packed
    after = merged(x)
    for y0, y1, ref, b in zip(before, after, refs, merged.bias.split(sizes)):
        assert rel_error(y1 - b, ref) < 0.02 and rel_error(y0 - b, ref) < 0.02
        assert y1.shape == y0.shape


def test_bad_shapes_are_clear_errors():
    raw = torch.from_numpy(random_blocks(T.Q4_0, 12, 64))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.ggml_pack_x8(raw, int(T.Q4_0), 64)
    packed = ops.ggml_pack_x8(raw[:8].contiguous(), int(T.Q4_0), 64)
    with pytest.raises(RuntimeError, match="do not match k=96"):
        ops.ggml_linear_x8(torch.randn(1, 96), [packed], [int(T.Q4_0)], 96)
    with pytest.raises(RuntimeError, match="outside the embedding"):
        ops.ggml_embed_x8(packed, torch.tensor([8]), int(T.Q4_0), 64)


def test_every_kernel_type_has_an_x8_layout():
    assert X8_TYPES == KERNEL_TYPES


def test_real_tensors_of_both_models(qwen_gguf, smollm_gguf):
    found = _real_tensors(qwen_gguf, X8_TYPES) | _real_tensors(smollm_gguf, X8_TYPES)
    assert {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.Q4_1} <= set(found)
    for qtype, (cols, raw) in found.items():
        w = torch.from_numpy(raw)
        packed = ops.ggml_pack_x8(w, int(qtype), cols)
        assert torch.equal(ops.ggml_unpack_x8(packed, int(qtype), cols), w), qtype.name
        ref = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(raw.shape[0], cols)).double()
        x = torch.randn(3, cols)
        y = ops.ggml_linear_x8(x, [packed], [int(qtype)], cols)[0]
        assert rel_error(y, x.double() @ ref.t()) < 0.02, qtype.name


def _extreme_low_bit_blocks(qtype: T, rows: int, k: int) -> np.ndarray:
    """Random blocks whose rows 0 and 1 hold the type's extremes: the largest scales and minimums
    with every value at its lowest and at its highest."""
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, rows, k, seed=9).reshape(rows, k // block, -1)
    if qtype == T.Q2_K:  # scales[16]; qs[64]: scale and minimum 15, values 0 and 3
        raw[:2, :, :16] = 0xFF
        raw[0, :, 16:80], raw[1, :, 16:80] = 0x00, 0xFF
    elif qtype == T.Q3_K:  # hmask[32]; qs[64]; scales[12]: scale 0 (-32), values -4 and 3
        raw[:2, :, 96:108] = 0x00
        raw[0, :, :96], raw[1, :, :96] = 0x00, 0xFF
    elif qtype == T.IQ4_XS:  # scales 0 (-32); nibbles 0 (-127) and 15 (113)
        raw[:2, :, 2:8] = 0x00
        raw[0, :, 8:], raw[1, :, 8:] = 0x00, 0xFF
    else:  # IQ4_NL: d the largest of the random ones; nibbles 0 (-127) and 15 (113)
        raw[:2, :, :2] = raw[:, :, :2].reshape(-1, 2)[np.abs(
            raw[:, :, :2].reshape(-1, 2).copy().view(np.float16)).argmax()]
        raw[0, :, 2:], raw[1, :, 2:] = 0x00, 0xFF
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_low_bit_rows_equal_alone_at_every_batch_size(qtype):
    """Q2_K, Q3_K, IQ4_NL and IQ4_XS: every batch of 1-65 rows gives each row the numbers of that row
    alone bit for bit, in each variant this CPU runs, at the extremes of weights and x."""
    k = 512
    raw = _extreme_low_bit_blocks(qtype, 16, k)
    packed = ops.ggml_pack_x8(torch.from_numpy(raw), int(qtype), k)
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(16, k)).double()
    x = torch.randn(65, k, generator=torch.Generator().manual_seed(4))
    x[3] = -1.0  # each block of x quantizes to -127 throughout
    x[4, ::32] = 100.0  # one +127 per block, the rest small
    before = ops.kernel_isa()[0]
    try:
        for variant in (v for v in ops.kernel_isas() if v != "generic"):
            ops.set_kernel_isa(variant)
            alone = torch.cat([ops.ggml_linear_x8(x[i:i + 1], [packed], [int(qtype)], k)[0] for i in range(65)])
            assert rel_error(alone, x.double() @ ref.t()) < 0.02
            for m in range(2, 66):
                y = ops.ggml_linear_x8(x[:m], [packed], [int(qtype)], k)[0]
                assert torch.equal(y, alone[:m]), f"{variant}: {m} rows differ from each row alone"
    finally:
        ops.set_kernel_isa(before)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_gated_block_types_are_linear_then_act(gelu):
    """ggml_gated_x8 on a Q4_K_M file's block types (gate Q4_K, up Q6_K): the two matmuls of
    ggml_linear_x8, then silu_mul / gelu_tanh_mul, the same bits."""
    types = [int(T.Q4_K), int(T.Q6_K)]
    packed = [ops.ggml_pack_x8(torch.from_numpy(random_blocks(T(t), 24, 256, seed=i)), t, 256)
              for i, t in enumerate(types)]
    x = torch.randn(5, 256)
    gate, up = ops.ggml_linear_x8(x, packed, types, 256)
    want = ops.gelu_tanh_mul(gate, up) if gelu else ops.silu_mul(gate, up)
    assert torch.equal(ops.ggml_gated_x8(x, packed, types, 256, gelu), want)
