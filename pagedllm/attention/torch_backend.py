"""Plain-PyTorch paged attention: the CPU path and the correctness oracle for other backends."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels import kernels_loaded


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values [T, Hkv, D] into the layer's cache [2, NB, BS, Hkv, D]."""
    if _cpu_kernel_applies(k, kv_cache):  # index_copy_ takes ~0.6 ms for 512 rows on the CPU
        torch.ops.pagedllm.write_kv_(kv_cache, k, v, slot_mapping)
        return
    _, nb, bs, h, d = kv_cache.shape
    kv_cache[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def _cpu_kernel_applies(x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The CPU kernels on the cache apply: float32 CPU tensors, kernels loaded."""
    return (x.device.type == "cpu" and x.dtype == kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and kernels_loaded())


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each request's paged context; returns [T, Hq, D]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    _, _, bs, h, d = kv_cache.shape
    if meta.decode is not None and _cpu_kernel_applies(q, kv_cache):
        dec = meta.decode
        # reads each sequence's K/V rows where they lie in the cache: no gathered copy
        out[:dec.num_tokens] = torch.ops.pagedllm.paged_decode_attention(
            q[:dec.num_tokens].contiguous(), kv_cache, dec.block_table, dec.context_lens, scale)
    elif meta.decode is not None:
        dec = meta.decode
        b = dec.num_tokens
        keys = kv_cache[0][dec.block_table].view(b, -1, h, d).transpose(1, 2)  # [B, Hkv, L, D]
        vals = kv_cache[1][dec.block_table].view(b, -1, h, d).transpose(1, 2)
        qd = q[:b].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=dec.mask, scale=scale,
                                           enable_gqa=True)
        out[:b] = o.squeeze(2)
    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.num_tokens)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]
        if seq.mask is None:  # the whole context is this chunk: no need to read the cache
            ks, vs = k[rows], v[rows]
        else:
            ks = kv_cache[0][seq.block_ids].view(-1, h, d)[:seq.context_len]
            vs = kv_cache[1][seq.block_ids].view(-1, h, d)[:seq.context_len]
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask,
                                           is_causal=seq.mask is None, scale=scale,
                                           enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
