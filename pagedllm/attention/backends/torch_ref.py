"""Plain-PyTorch paged attention: every platform's fallback and the oracle for other backends.

K/V are written with index_copy_; decode reads each request's blocks through a padded block table
with a boolean mask; prompt chunks run scaled_dot_product_attention over their context. A layer
with a sliding window or soft-capped scores (Gemma) takes attention/masked.py instead, in every
backend that subclasses this one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from pagedllm.attention.masked import masked_attention, window_mask
from pagedllm.attention.metadata import AttentionMetadata, CommonAttentionInputs, PrefillSeq


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The common metadata plus the decode mask SDPA needs."""

    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool, True = attend


class TorchMetadataBuilder:
    """CommonAttentionInputs -> TorchAttentionMetadata."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(self, common: CommonAttentionInputs) -> TorchAttentionMetadata:
        """Add the decode rows' attention mask."""
        mask = None
        if common.decode is not None:
            dec = common.decode
            width = dec.block_table.shape[1] * self.block_size
            keys = torch.arange(width, device=dec.context_lens.device)
            mask = (keys[None, :] < dec.context_lens[:, None])[:, None, None, :]
        return TorchAttentionMetadata(common.slot_mapping, common.decode, common.prefills, mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values [T, Hkv, D] into the layer's cache [2, NB, BS, Hkv, D]."""
    _, nb, bs, h, d = kv_cache.shape
    kv_cache[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _context_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 seq: PrefillSeq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One prompt chunk's queries [1, Hq, S, D] and its context's keys and values
    [1, Hkv, C, D]."""
    _, _, _, h, d = kv_cache.shape
    rows = slice(seq.start, seq.start + seq.num_tokens)
    qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]
    if seq.mask is None:  # the whole context is this chunk: no need to read the cache
        ks, vs = k[rows], v[rows]
        if kv_cache.dtype != k.dtype:  # the cached values (a bf16 cache's rounding), as a later
            ks, vs = ks.to(kv_cache.dtype), vs.to(kv_cache.dtype)  # chunk or decode reads them
    else:
        ks = kv_cache[0][seq.block_ids].view(-1, h, d)[:seq.context_len]
        vs = kv_cache[1][seq.block_ids].view(-1, h, d)[:seq.context_len]
    ks = ks.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, C, D]
    vs = vs.transpose(0, 1).unsqueeze(0).to(q.dtype)
    return qs, ks, vs


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      seq: PrefillSeq, scale: float, out: torch.Tensor) -> None:
    """Causal attention of one prompt chunk's rows of q over its context, into out's rows."""
    rows = slice(seq.start, seq.start + seq.num_tokens)
    qs, ks, vs = _context_kv(q, k, v, kv_cache, seq)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, is_causal=seq.mask is None,
                                       scale=scale, enable_gqa=True)
    out[rows] = o.squeeze(0).transpose(0, 1)


class TorchAttentionImpl:
    """Paged attention in PyTorch ops. Other backends subclass it and replace write_kv and
    decode; the batch layout (decode rows first, then prompt chunks) is handled here once."""

    decode_takes_window = False  # whether decode() runs a sliding window itself
    decode_takes_softcap = False  # whether decode() soft-caps the scores itself

    def __init__(self, scale: float, sliding_window: Optional[int] = None,
                 softcap: Optional[float] = None) -> None:
        self.scale = scale
        self.sliding_window, self.softcap = sliding_window, softcap
        # decided once: a window or a soft-cap takes the masked PyTorch path in every backend,
        # but for a decode that runs them itself
        masked = sliding_window is not None or softcap is not None
        masked_decode = ((softcap is not None and not self.decode_takes_softcap)
                         or (sliding_window is not None and not self.decode_takes_window))
        self._decode = self.masked_decode if masked_decode else self.decode
        self._prefill = self.masked_prefill if masked else self.prefill

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each request's paged context; returns [T, Hq, D]."""
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.decode_only:  # every row is a decode row: no output to assemble
            return self._decode(q, kv_cache, meta)
        out = torch.empty_like(q)
        if meta.decode is not None:
            b = meta.decode.num_tokens
            out[:b] = self._decode(q[:b], kv_cache, meta)
        for seq in meta.prefills:
            self._prefill(q, k, v, kv_cache, seq, out)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                seq: PrefillSeq, out: torch.Tensor) -> None:
        """Causal attention of one prompt chunk (SDPA), into out's rows."""
        prefill_attention(q, k, v, kv_cache, seq, self.scale, out)

    def masked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, seq: PrefillSeq, out: torch.Tensor) -> None:
        """One prompt chunk with the layer's window and soft-cap, into out's rows."""
        qs, ks, vs = _context_kv(q, k, v, kv_cache, seq)
        # the chunk's queries are the last num_tokens positions of its context
        first_q = seq.context_len - seq.num_tokens
        q_pos = first_q + torch.arange(seq.num_tokens, device=q.device)
        # keys before the first query's window are seen by no query: leave them out, so the
        # scores stay [S, S + window] however long the context
        first = 0 if self.sliding_window is None else max(0, first_q - self.sliding_window + 1)
        mask = window_mask(q_pos, seq.context_len, self.sliding_window, first)  # [S, C - first]
        o = masked_attention(qs, ks[:, :, first:], vs[:, :, first:], mask, self.scale,
                             self.softcap)  # [1, Hq, S, D]
        out[seq.start:seq.start + seq.num_tokens] = o.squeeze(0).transpose(0, 1)

    def masked_decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows q [B, Hq, D] with the layer's window and soft-cap; [B, Hq, D]. Reads only
        the common metadata, so that every backend can take it."""
        _, _, _, h, d = kv_cache.shape
        dec = meta.decode
        b = dec.num_tokens
        keys = kv_cache[0][dec.block_table].view(b, -1, h, d).transpose(1, 2)  # [B, Hkv, L, D]
        vals = kv_cache[1][dec.block_table].view(b, -1, h, d).transpose(1, 2)
        # the padded table's keys past a row's context fall outside its causal mask
        mask = window_mask(dec.context_lens - 1, keys.shape[2], self.sliding_window)  # [B, L]
        o = masked_attention(q.unsqueeze(2), keys.to(q.dtype), vals.to(q.dtype),
                             mask[:, None, None, :], self.scale, self.softcap)  # [B, Hq, 1, D]
        return o.squeeze(2)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's keys and values into the layer's cache."""
        write_kv(kv_cache, k, v, slot_mapping)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
               meta: TorchAttentionMetadata) -> torch.Tensor:
        """Attention of the decode rows q [B, Hq, D] over their block tables; [B, Hq, D]."""
        _, _, _, h, d = kv_cache.shape
        dec = meta.decode
        b = dec.num_tokens
        keys = kv_cache[0][dec.block_table].view(b, -1, h, d).transpose(1, 2)  # [B, Hkv, L, D]
        vals = kv_cache[1][dec.block_table].view(b, -1, h, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys.to(q.dtype), vals.to(q.dtype),
                                           attn_mask=meta.decode_mask, scale=self.scale,
                                           enable_gqa=True)  # [B, Hq, 1, D]
        return o.squeeze(2)


class TorchAttentionBackend:
    """The plain-PyTorch backend."""

    name = "torch"
    impl_cls = TorchAttentionImpl
    builder_cls = TorchMetadataBuilder
