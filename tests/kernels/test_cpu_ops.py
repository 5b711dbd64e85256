"""The fused CPU ops against the plain-PyTorch code they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import load_kernels

ops = torch.ops.pagedllm


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernels()


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_rms_norm_and_fused_residual_add():
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    torch.testing.assert_close(torch.ops.pagedllm.rms_norm(x, w, 1e-6), _rms(x, w, 1e-6))
    want_sum = x + res
    want = _rms(want_sum, w, 1e-5)
    torch.ops.pagedllm.add_rms_norm_(x, res, w, 1e-5)
    torch.testing.assert_close(res, want_sum)
    torch.testing.assert_close(x, want)


def test_rope_matches_rotate_half():
    t, hq, hk, d = 4, 6, 2, 32
    q, k = torch.randn(t, hq, d), torch.randn(t, hk, d)
    angles = torch.rand(50, d // 2) * 10
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    pos = torch.tensor([0, 7, 7, 49])

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        half = torch.cat((-x2, x1), dim=-1)
        return x * cos[pos][:, None] + half * sin[pos][:, None]

    want_q, want_k = rotate(q), rotate(k)
    torch.ops.pagedllm.rope_(q, k, pos, cos, sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        torch.ops.pagedllm.rope_(q, k, torch.tensor([0, 1, 2, 50]), cos, sin)


def test_rope_turns_only_the_first_rotary_dim_values_of_each_head():
    t, hq, hk, d, r = 3, 4, 2, 32, 24  # Phi-4-mini turns 96 of 128
    q, k = torch.randn(t, hq, d), torch.randn(t, hk, d)
    angles = torch.rand(20, r // 2) * 10
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    pos = torch.tensor([0, 3, 19])

    def rotate(x):
        x1, x2 = x[..., :r].chunk(2, dim=-1)
        turned = x[..., :r] * cos[pos][:, None] + torch.cat((-x2, x1), -1) * sin[pos][:, None]
        return torch.cat((turned, x[..., r:]), -1)

    want_q, want_k = rotate(q), rotate(k)
    torch.ops.pagedllm.rope_(q, k, pos, cos, sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    with pytest.raises(RuntimeError, match="rotary_dim even and at most head_dim"):
        torch.ops.pagedllm.rope_(q, k, pos, torch.randn(20, 34), torch.randn(20, 34))


@pytest.mark.parametrize("d", [16, 64, 128])  # 64 and 128 take a SIMD path, 16 the plain one
def test_paged_decode_attention_reads_blocks_in_place(d):
    hq, hk, bs = 8, 2, 4
    kv = torch.randn(2, 12, bs, hk, d)
    # two sequences: 37 tokens in ten shuffled blocks, 3 tokens in block [0] (table padded with 0)
    table = torch.tensor([[7, 2, 5, 11, 1, 9, 3, 10, 4, 6], [0] * 10])
    lens = torch.tensor([37, 3])
    q = torch.randn(2, hq, d)
    out = torch.ops.pagedllm.paged_decode_attention(q, kv, table, lens, 0.25)
    for i in range(2):
        n = int(lens[i])
        keys = kv[0][table[i]].reshape(-1, hk, d)[:n].transpose(0, 1)  # [Hk, n, D]
        vals = kv[1][table[i]].reshape(-1, hk, d)[:n].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], keys, vals, scale=0.25,
                                             enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], ref)
    with pytest.raises(RuntimeError, match="block id out of range"):
        bad = torch.tensor([[7, 2, 12] + [0] * 7, [0] * 10])  # block 12 of 12
        torch.ops.pagedllm.paged_decode_attention(q, kv, bad, lens, 0.25)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_decode_attention_over_partial_key_blocks_and_head_groups(d):
    """Lengths around the 16-key blocks the AVX-512 path reduces together, and 7 query heads per
    K/V head (Qwen2.5-0.5B's grouping: value rows are weighed for 4 heads, then 3)."""
    hq, hk, bs = 14, 2, 16
    lens = torch.tensor([1, 15, 16, 17, 33, 70])
    blocks = -(-int(lens.max()) // bs)
    kv = torch.randn(2, len(lens) * blocks, bs, hk, d)
    table = torch.randperm(len(lens) * blocks).view(len(lens), blocks)
    q = torch.randn(len(lens), hq, d)
    out = torch.ops.pagedllm.paged_decode_attention(q, kv, table, lens, d ** -0.5)
    for i, n in enumerate(lens.tolist()):
        keys = kv[0][table[i]].reshape(-1, hk, d)[:n].transpose(0, 1)  # [Hk, n, D]
        vals = kv[1][table[i]].reshape(-1, hk, d)[:n].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], keys, vals, scale=d ** -0.5,
                                             enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], ref)


@pytest.mark.parametrize("d", [32, 64, 128, 256])  # the scalar path, then the vector ones
@pytest.mark.parametrize("window", [1, 7, 16, 20])
def test_paged_decode_attention_with_a_window_reads_only_the_last_rows(d, window):
    """A window gives bit for bit what the windowless op gives over a cache holding just each
    sequence's last `window` rows, and transformers' window mask's numbers (masked.py)."""
    from pagedllm.attention.masked import masked_attention, window_mask
    hq, hk, bs = 14, 2, 16
    lens = torch.tensor([1, 7, 15, 16, 17, 33, 70])
    blocks = -(-int(lens.max()) // bs)
    kv = torch.randn(2, len(lens) * blocks, bs, hk, d)
    table = torch.randperm(len(lens) * blocks).view(len(lens), blocks)
    q = torch.randn(len(lens), hq, d)
    out = ops.paged_decode_attention(q, kv, table, lens, d ** -0.5, window)
    for i, n in enumerate(lens.tolist()):
        rows = kv[:, table[i]].reshape(2, -1, hk, d)[:, :n]  # [2, n, Hk, D]
        last = rows[:, max(0, n - window):]
        kept = torch.zeros(2, blocks * bs, hk, d)
        kept[:, :last.shape[1]] = last
        alone = ops.paged_decode_attention(q[i:i + 1], kept.view(2, blocks, bs, hk, d),
                                           torch.arange(blocks)[None], torch.tensor([len(last[0])]),
                                           d ** -0.5)
        assert torch.equal(out[i], alone[0])
        mask = window_mask(torch.tensor([n - 1]), n, window)  # [1, n]
        ref = masked_attention(q[i][None, :, None], rows[0].transpose(0, 1)[None],
                               rows[1].transpose(0, 1)[None], mask, d ** -0.5, None)
        torch.testing.assert_close(out[i], ref[0, :, 0])
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.paged_decode_attention(q, kv, table, lens, 0.25, -1)


@pytest.mark.parametrize("d", [32, 64, 256])  # the scalar path, then the vector ones
@pytest.mark.parametrize("window", [0, 7])
def test_paged_decode_attention_soft_caps_the_scores_as_masked_attention(d, window):
    """Gemma 2's soft-cap (tanh(s / cap) * cap before the softmax), with and without a window:
    transformers' numbers (masked.py), and other numbers than without the cap."""
    from pagedllm.attention.masked import masked_attention, window_mask
    hq, hk, bs, cap = 8, 2, 16, 1.5
    lens = torch.tensor([1, 15, 33])
    blocks = -(-int(lens.max()) // bs)
    kv = torch.randn(2, len(lens) * blocks, bs, hk, d)
    table = torch.randperm(len(lens) * blocks).view(len(lens), blocks)
    q = torch.randn(len(lens), hq, d) * 2
    out = ops.paged_decode_attention(q, kv, table, lens, d ** -0.5, window, cap)
    assert not torch.allclose(out, ops.paged_decode_attention(q, kv, table, lens, d ** -0.5, window))
    for i, n in enumerate(lens.tolist()):
        rows = kv[:, table[i]].reshape(2, -1, hk, d)[:, :n]  # [2, n, Hk, D]
        mask = window_mask(torch.tensor([n - 1]), n, window or None)  # [1, n]
        ref = masked_attention(q[i][None, :, None], rows[0].transpose(0, 1)[None],
                               rows[1].transpose(0, 1)[None], mask, d ** -0.5, cap)
        torch.testing.assert_close(out[i], ref[0, :, 0])
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ops.paged_decode_attention(q, kv, table, lens, 0.25, 0, -1.0)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])  # the plain path, then the vector ones
def test_one_stream_with_fewer_kv_heads_than_threads_splits_its_query_heads_bit_for_bit(d, isa):
    """One sequence whose K/V heads are fewer than the threads (Gemma 3 270M: one K/V head of
    four query heads) has its query heads split over the threads; each head's numbers are the
    ones it gets in a batch that splits nothing (one task per sequence)."""
    if isa not in ops.kernel_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    hq, hk, bs = 4, 1, 16
    kv = torch.randn(2, 160, bs, hk, d)
    q = torch.randn(8, hq, d)
    before, threads = ops.kernel_isa()[0], torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ops.set_kernel_isa(isa)
        # 45 keys split; 2,100 (2,100 x d x 8 bytes: past the 1 MiB bound at d 64 and up) do not
        for n in (45, 2100):
            table = torch.randperm(160)[:-(-n // bs)].view(1, -1)
            batch = ops.paged_decode_attention(q, kv, table.expand(8, -1).contiguous(),
                                               torch.full((8,), n), d ** -0.5)
            for i in (0, 5):
                alone = ops.paged_decode_attention(q[i:i + 1], kv, table, torch.tensor([n]),
                                                   d ** -0.5)
                assert torch.equal(alone[0], batch[i])
    finally:
        ops.set_kernel_isa(before)
        torch.set_num_threads(threads)


def test_gelu_tanh_mul_does_not_depend_on_where_a_value_falls():
    """A value is the same whether it fell in an 8-wide vector or in the scalar tail."""
    gate, up = torch.randn(2048) * 5, torch.randn(2048)
    whole = ops.gelu_tanh_mul(gate, up)
    pieces = torch.cat([ops.gelu_tanh_mul(g.contiguous(), u.contiguous())
                        for g, u in zip(gate.split(7), up.split(7))])
    assert torch.equal(whole, pieces)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_decode_attention_is_the_same_in_the_avx512_and_avx2_paths(d):
    """An AVX-512 CPU runs the AVX-512 path unless the avx2 kernels are forced; both give the
    same numbers bit for bit, so both are run here where the CPU can."""
    if "avx512vnni" not in ops.kernel_isas():
        pytest.skip("this CPU lacks avx512f/bw/vl/vnni: only the AVX2 path runs here")
    hq, hk, bs = 14, 2, 16
    lens = torch.tensor([1, 15, 16, 17, 33, 70, 129])
    blocks = -(-int(lens.max()) // bs)
    kv = torch.randn(2, len(lens) * blocks, bs, hk, d)
    table = torch.randperm(len(lens) * blocks).view(len(lens), blocks)
    q = torch.randn(len(lens), hq, d)
    before = ops.kernel_isa()[0]
    try:
        ops.set_kernel_isa("avx2")
        assert ops.paged_attention_path() == "avx2"
        avx2 = [ops.paged_decode_attention(q, kv, table, lens, d ** -0.5, w, c)
                for w, c in ((0, 0.0), (20, 0.0), (0, 2.0))]
        ops.set_kernel_isa("avx512vnni")
        assert ops.paged_attention_path() == "avx512"  # a build for this CPU has both paths
        avx512 = [ops.paged_decode_attention(q, kv, table, lens, d ** -0.5, w, c)
                  for w, c in ((0, 0.0), (20, 0.0), (0, 2.0))]
    finally:
        ops.set_kernel_isa(before)
    assert all(torch.equal(a, b) for a, b in zip(avx2, avx512))


def _isas() -> list[str]:
    """The attention paths this CPU runs: AVX2, and AVX-512 where it has it."""
    return ["avx2"] + (["avx512vnni"] if "avx512vnni" in ops.kernel_isas() else [])


@pytest.mark.parametrize("d", [32, 64, 128, 256])  # 32: the generic loop, the others vectors
def test_a_bf16_cache_gives_the_numbers_of_a_float32_cache_of_its_values(d):
    """kv_cache_dtype "bfloat16": a bf16 row widens to float32 exactly, so attention over a bf16
    cache is, bit for bit, attention over a float32 cache holding the same rounded values, on
    each path (windows, soft-capping, one sequence whose query heads split over the threads)."""
    hq, hk, bs = 14, 2, 16
    lens = torch.tensor([1, 15, 16, 17, 33, 70, 129])
    blocks = -(-int(lens.max()) // bs)
    kv = torch.randn(2, len(lens) * blocks, bs, hk, d).to(torch.bfloat16)
    table = torch.randperm(len(lens) * blocks).view(len(lens), blocks)
    q = torch.randn(len(lens), hq, d)
    before = ops.kernel_isa()[0]
    try:
        for isa in _isas():
            ops.set_kernel_isa(isa)
            for w, c in ((0, 0.0), (20, 0.0), (0, 2.0)):
                for rows in (slice(None), slice(5, 6)):
                    args = (q[rows].contiguous(), table[rows].contiguous(), lens[rows].contiguous())
                    got = ops.paged_decode_attention(args[0], kv, *args[1:], d ** -0.5, w, c)
                    want = ops.paged_decode_attention(args[0], kv.float(), *args[1:], d ** -0.5, w, c)
                    assert torch.equal(got, want), (isa, w, c, rows)
    finally:
        ops.set_kernel_isa(before)


def test_write_kv_into_a_bf16_cache_rounds_as_torch():
    """K/V rows written into a bf16 cache are torch's .to(torch.bfloat16) of them (nearest even,
    ties, infinities, subnormals; NaN stays NaN); other slots stay as they were; a float16 cache
    is refused."""
    t, hk, d = 5, 2, 64
    k, v = torch.randn(t, hk, d) * 3, torch.randn(t, hk, d)
    k.view(-1)[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39,
                                   1.0 + 2 ** -8])  # the last a tie, to even (1.0)
    kv = torch.full((2, 4, 4, hk, d), 7.0, dtype=torch.bfloat16)
    slots = torch.tensor([3, 0, 9, 15, 4])
    ops.write_kv_(kv, k, v, slots)
    flat = kv.view(2, 16, hk, d)

    def bits(x):  # a NaN's payload is torch's or c10's choice: NaN compares as NaN
        return torch.where(x.isnan(), torch.tensor(-1, dtype=torch.int16), x.view(torch.int16))

    for i, s in enumerate(slots.tolist()):
        assert torch.equal(bits(flat[0, s]), bits(k[i].to(torch.bfloat16)))
        assert torch.equal(bits(flat[1, s]), bits(v[i].to(torch.bfloat16)))
    assert bool(flat[0, 3, 0, 2].isnan()) and flat[0, 3, 0, 5] == 1.0
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert bool((flat[:, untouched] == 7.0).all())
    with pytest.raises(RuntimeError, match="kv must be a contiguous float32 or bfloat16 CPU tensor"):
        ops.write_kv_(kv.half(), k, v, slots)
    with pytest.raises(RuntimeError, match="kv_cache must be a contiguous float32 or bfloat16"):
        ops.paged_decode_attention(torch.randn(1, 4, d), kv.half(), torch.zeros(1, 4, dtype=torch.long),
                                   torch.tensor([3]), 0.25)


def test_gelu_tanh_mul_matches_torch():
    gate, up = torch.randn(3, 2051) * 4, torch.randn(3, 2051)
    gate[0, :2] = torch.tensor([30.0, -30.0])
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(ops.gelu_tanh_mul(gate, up), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.gelu_tanh_mul(gate, up[:2])


def test_silu_mul_matches_torch_and_does_not_depend_on_the_length():
    gate = torch.randn(3, 4867) * 6
    gate[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # no overflow at either end
    up = torch.randn(3, 4867)
    out = ops.silu_mul(gate, up)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()
    # a value is the same whether it fell in an 8-wide vector or in the scalar tail: every value
    # of the first 4864 (a multiple of 8, all vectors) again in pieces of 7 (all tail)
    g, u = gate[1, :4864].contiguous(), up[1, :4864].contiguous()
    whole = ops.silu_mul(g, u)
    tails = torch.cat([ops.silu_mul(g[i:i + 7].contiguous(), u[i:i + 7].contiguous())
                       for i in range(0, 4864, 7)])
    assert torch.equal(tails, whole)


def test_argmax_rows_is_torch_argmax():
    x = torch.randn(4, 151936)
    x[1, 7] = x[1, 151930] = 100.0  # ties: the first index, as torch
    x[2] = -torch.inf
    x[3, 11] = torch.nan  # a NaN wins, as in torch
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:, :5].contiguous()), x[:, :5].argmax(dim=-1))


def test_write_kv_stores_rows_where_index_copy_does():
    kv = torch.randn(2, 5, 4, 2, 8)  # [2, blocks, block_size, kv_heads, head_dim]
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([3, 17, 0, 19, 8, 9])
    ref = kv.clone()
    ref[0].view(20, 2, 8).index_copy_(0, slots, k)
    ref[1].view(20, 2, 8).index_copy_(0, slots, v)
    ops.write_kv_(kv, k, v, slots)
    assert torch.equal(kv, ref)
    with pytest.raises(RuntimeError, match="slot 20 is outside the KV cache's 20 slots"):
        ops.write_kv_(kv, k[:1], v[:1], torch.tensor([20]))
    with pytest.raises(RuntimeError, match="kv_heads \\* head_dim values per slot"):
        ops.write_kv_(kv, k[:, :1], v[:, :1], slots)


def test_norm_refuses_a_weight_that_does_not_match_the_rows():
    x, w = torch.randn(4, 96), torch.randn(95)
    with pytest.raises(RuntimeError, match=r"x must be \[\.\.\., 95\]"):
        ops.rms_norm(x, w, 1e-6)
    with pytest.raises(RuntimeError, match="non-empty 1-D"):
        ops.add_rms_norm_(x, x.clone(), torch.empty(0), 1e-6)


def test_rope_refuses_mismatched_k_positions_and_tables():
    q, k = torch.randn(4, 6, 32), torch.randn(4, 2, 32)
    cos = sin = torch.randn(50, 32)
    pos = torch.tensor([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="k must have q's tokens"):
        ops.rope_(q, torch.randn(3, 2, 32), pos, cos, sin)  # fewer tokens in k
    with pytest.raises(RuntimeError, match="one position per token: 4 tokens, 2 positions"):
        ops.rope_(q, k, pos[:2].contiguous(), cos, sin)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.rope_(q, k, pos, cos, torch.randn(10, 32))  # a shorter sin table
    with pytest.raises(RuntimeError, match=r"\[T, heads, head_dim\]"):
        ops.rope_(q.view(4, -1), k, pos, cos, sin)


def test_paged_decode_attention_refuses_tables_of_the_wrong_batch_and_empty_caches():
    q, kv = torch.randn(2, 8, 16), torch.randn(2, 12, 4, 2, 16)
    table, lens = torch.zeros(2, 3, dtype=torch.long), torch.tensor([5, 3])
    with pytest.raises(RuntimeError, match="one row per sequence"):
        ops.paged_decode_attention(q, kv, table[:1].contiguous(), lens, 0.25)
    with pytest.raises(RuntimeError, match="one row per sequence"):
        ops.paged_decode_attention(q, kv, table, lens[:1].contiguous(), 0.25)
    with pytest.raises(RuntimeError, match="kv_heads > 0"):  # was an integer division by zero
        ops.paged_decode_attention(q, torch.randn(2, 12, 4, 0, 16), table, lens, 0.25)
    with pytest.raises(RuntimeError, match="context length 13 out of range"):
        ops.paged_decode_attention(q, kv, table, torch.tensor([13, 3]), 0.25)
    with pytest.raises(RuntimeError, match=r"kv_cache must be \[2, blocks"):
        ops.paged_decode_attention(q, kv[0], table, lens, 0.25)


def test_decode_stack_refuses_impossible_head_counts():
    cos = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="positive multiple of num_kv_heads"):
        torch.classes.pagedllm.DecodeStack(4, 0, 16, 1e-6, 0.25, cos, cos)
    with pytest.raises(RuntimeError, match="head_dim must be positive and even"):
        torch.classes.pagedllm.DecodeStack(4, 2, 15, 1e-6, 0.25, torch.randn(8, 15), torch.randn(8, 15))
    with pytest.raises(RuntimeError, match="same shape"):
        torch.classes.pagedllm.DecodeStack(4, 2, 16, 1e-6, 0.25, cos, torch.randn(8, 8))


def test_partial_rotary_embedding_gives_the_same_numbers_in_cpp_and_pytorch():
    from pagedllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(24, 64, 10000.0)  # 24 of each head's 32 values
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    pos = torch.tensor([0, 1, 17, 40, 63])
    want_q, want_k = rope.forward_native(pos, q, k)
    got_q, got_k = rope.forward_cpu(pos, q.clone(), k.clone())
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    assert torch.equal(got_q[..., 24:], q[..., 24:])
