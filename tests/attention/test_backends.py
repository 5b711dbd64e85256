"""The CPU attention backend against the plain-PyTorch reference on random paged caches, and the
reference against dense causal attention computed from scratch."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pagedllm.attention.backends import cpu as cpu_backend
from pagedllm.attention.backends.cpu import CpuAttentionBackend
from pagedllm.attention.backends.torch_ref import TorchAttentionBackend
from pagedllm.attention.metadata import CommonAttentionInputs, DecodeBatch, PrefillSeq
from pagedllm.kernels import load_kernels

BS, HQ, HKV, D = 4, 6, 2, 16
NUM_BLOCKS = 40


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    load_kernels()


MIXED = [(9, 1), (2, 1), (0, 7), (6, 5)]  # (tokens already in the cache, tokens this step)


def _layout(seed: int, reqs=MIXED):
    """Two decoding requests and two prompt chunks (one fresh, one continuing a cached prefix)
    with scattered, shuffled block ids, plus each request's full history of K/V."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1  # block 0 is only padding
    owned, cursor = [], 0
    for done, new in reqs:
        n = -(-(done + new) // BS)
        owned.append(blocks[cursor:cursor + n].tolist())
        cursor += n
    hist = [(torch.randn(done + new, HKV, D, generator=g), torch.randn(done + new, HKV, D, generator=g))
            for done, new in reqs]
    return reqs, owned, hist, g


def _inputs(reqs, owned, hist, g):
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    slots, qs, ks, vs, prefills = [], [], [], [], []
    row = 0
    for i, ((done, new), ids, (k, v)) in enumerate(zip(reqs, owned, hist)):
        for p in range(done):  # what earlier steps cached
            cache[0, ids[p // BS], p % BS] = k[p]
            cache[1, ids[p // BS], p % BS] = v[p]
        slots += [ids[p // BS] * BS + p % BS for p in range(done, done + new)]
        ks.append(k[done:]), vs.append(v[done:]), qs.append(torch.randn(new, HQ, D, generator=g))
        if new > 1:
            ctx = done + new
            mask = None
            if done:
                mask = torch.arange(ctx)[None, :] <= (done + torch.arange(new))[:, None]
            prefills.append(PrefillSeq(row, new, ctx, torch.tensor(ids), mask))
        row += new
    decodes = [(done + 1, ids) for (done, new), ids in zip(reqs, owned) if new == 1]
    dec = None
    if decodes:
        width = max(-(-c // BS) for c, _ in decodes)
        table = torch.tensor([ids[:-(-c // BS)] + [0] * (width - len(ids[:-(-c // BS)]))
                              for c, ids in decodes])
        dec = DecodeBatch(len(decodes), table, torch.tensor([c for c, _ in decodes]))
    common = CommonAttentionInputs(torch.tensor(slots), dec, prefills)
    return cache, torch.cat(qs), torch.cat(ks), torch.cat(vs), common


def _run(backend, cache, q, k, v, common):
    meta = backend.builder_cls(BS).build(common)
    out = backend.impl_cls(D ** -0.5).forward(q, k, v, cache, meta)
    return out, cache


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_backend_matches_the_reference_on_a_mixed_batch(seed):
    reqs, owned, hist, g = _layout(seed)
    ref_in = _inputs(reqs, owned, hist, torch.Generator().manual_seed(seed + 100))
    cpu_in = _inputs(reqs, owned, hist, torch.Generator().manual_seed(seed + 100))
    ref, ref_cache = _run(TorchAttentionBackend, *ref_in)
    out, cpu_cache = _run(CpuAttentionBackend, *cpu_in)
    assert torch.equal(cpu_cache, ref_cache)  # the same K/V bytes in the same slots
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reqs", [MIXED, [(9, 1), (2, 1), (6, 5), (0, 7)], [(6, 5), (0, 7)]],
                         ids=["mixed", "long-chunk-first", "prompts-only"])
@pytest.mark.parametrize("limit", [0, 8, 2048])
def test_prompt_chunks_paged_or_not_match_the_reference(reqs, limit, monkeypatch):
    """Prompt chunks of a context up to the limit go through the paged kernel with the decode
    rows, longer ones through SDPA: none (0), some (8: the chunk of 11 rows is long; first in
    the batch, the paged rows are not a prefix of it), all (2048); with and without decode rows."""
    monkeypatch.setattr(cpu_backend, "PAGED_PREFILL_MAX_CONTEXT", limit)
    layout = _layout(0, reqs)[:3]
    ref, _ = _run(TorchAttentionBackend, *_inputs(*layout, torch.Generator().manual_seed(7)))
    cpu_in = _inputs(*layout, torch.Generator().manual_seed(7))
    meta = CpuAttentionBackend.builder_cls(BS).build(cpu_in[-1])
    short = [new for done, new in reqs if new > 1 and done + new <= limit]
    decode_rows = sum(new for _, new in reqs if new == 1)
    assert (meta.paged is not None) == bool(short)
    if short:
        assert meta.paged.num_tokens == decode_rows + sum(short)
        assert (meta.paged_rows is None) == (reqs is MIXED or limit == 2048)
    out, _ = _run(CpuAttentionBackend, *cpu_in)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_bf16_cache_is_a_float32_cache_of_rounded_values(seed):
    """kv_cache_dtype "bfloat16": a mixed batch (decode rows, a fresh prompt chunk, one after a
    cached prefix) over a bf16 cache gives, bit for bit, what a float32 cache gives when every
    key and value, history and this step's, is rounded to bf16 first: the fresh chunk's own
    keys and values are rounded before its attention, as every later read sees them."""
    reqs, owned, hist, _ = _layout(seed)
    cache, q, k, v, common = _inputs(reqs, owned, hist, torch.Generator().manual_seed(seed + 100))
    rounded = [t.to(torch.bfloat16).float() for t in (cache, k, v)]
    want, want_cache = _run(CpuAttentionBackend, rounded[0], q, rounded[1], rounded[2], common)
    out, bf16_cache = _run(CpuAttentionBackend, cache.to(torch.bfloat16), q, k, v, common)
    assert bf16_cache.dtype == torch.bfloat16 and torch.equal(bf16_cache.float(), want_cache)
    assert torch.equal(out, want)


def test_cpu_backend_decode_only_step_matches_the_reference():
    reqs, owned, hist, _ = _layout(5)
    reqs, owned, hist = reqs[:2], owned[:2], hist[:2]  # the two decoding requests alone
    args = _inputs(reqs, owned, hist, torch.Generator().manual_seed(7))
    ref, _ = _run(TorchAttentionBackend, *[a.clone() if torch.is_tensor(a) else a for a in args])
    out, _ = _run(CpuAttentionBackend, *args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_reference_equals_dense_causal_attention():
    reqs, owned, hist, _ = _layout(3)
    cache, q, k, v, common = _inputs(reqs, owned, hist, torch.Generator().manual_seed(9))
    out, _ = _run(TorchAttentionBackend, cache, q, k, v, common)
    row = 0
    for (done, new), (kh, vh) in zip(reqs, hist):
        qs = q[row:row + new].transpose(0, 1)  # [Hq, S, D]
        keys = kh.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [Hq, C, D]
        vals = vh.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
        scores = qs @ keys.transpose(1, 2) * D ** -0.5  # [Hq, S, C]
        visible = torch.arange(done + new)[None, :] <= (done + torch.arange(new))[:, None]
        want = F.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vals
        torch.testing.assert_close(out[row:row + new], want.transpose(0, 1), rtol=1e-5, atol=1e-5)
        row += new


def test_metadata_builders():
    reqs, owned, hist, g = _layout(0)
    common = _inputs(reqs, owned, hist, g)[-1]
    ref = TorchAttentionBackend.builder_cls(BS).build(common)
    cpu = CpuAttentionBackend.builder_cls(BS).build(common)
    # the reference masks padded keys; the C++ kernel reads context_lens instead
    ctx = common.decode.context_lens
    assert ref.decode_mask.shape == (2, 1, 1, common.decode.block_table.shape[1] * BS)
    assert ref.decode_mask.sum(-1).flatten().tolist() == ctx.tolist()
    assert not hasattr(cpu, "decode_mask") and cpu.decode is common.decode
    assert not ref.decode_only and not cpu.decode_only


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
@pytest.mark.parametrize("window, cap", [(1, None), (3, None), (16, None), (None, 0.5), (3, 0.5),
                                         (5, 2.0)])
def test_window_and_softcap_equal_dense_attention(backend, window, cap):
    """Decode rows, a fresh prompt and a chunk over cached blocks, each query seeing keys at
    p - window < k <= p, scores soft-capped, as computed from scratch (Gemma's layers; a window
    alone is also Mistral's, Qwen2's and Phi-3's, and decodes in C++ in the CPU backend)."""
    reqs, owned, hist, _ = _layout(4)
    cache, q, k, v, common = _inputs(reqs, owned, hist, torch.Generator().manual_seed(11))
    meta = backend.builder_cls(BS).build(common)
    out = backend.impl_cls(D ** -0.5, window, cap).forward(q, k, v, cache, meta)
    row = 0
    for (done, new), (kh, vh) in zip(reqs, hist):
        qs = q[row:row + new].transpose(0, 1)  # [Hq, S, D]
        keys = kh.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [Hq, C, D]
        vals = vh.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
        scores = qs @ keys.transpose(1, 2) * D ** -0.5  # [Hq, S, C]
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        q_pos, k_pos = done + torch.arange(new), torch.arange(done + new)
        visible = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        want = F.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vals
        torch.testing.assert_close(out[row:row + new], want.transpose(0, 1), rtol=1e-5, atol=1e-5)
        row += new
