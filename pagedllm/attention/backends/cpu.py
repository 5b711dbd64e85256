"""The CPU backend: C++ K/V writes and batched paged attention over a float32 or bf16 cache
(kernels/csrc/paged_attention.cpp); PyTorch SDPA for long prompt chunks.

The paged kernel reads each request's K/V rows where they lie in the cache: no gathered copy, no
mask; a sliding window reads only the last `window` rows, and soft-capped scores (Gemma 2) are
capped in the kernel. It computes one query row at a time over that row's context, so a prompt
chunk whose context is at most PAGED_PREFILL_MAX_CONTEXT rows runs through it too, each of its
rows as a decode row at its position (with the step's decode rows, in one call): per-call
overhead made SDPA's per-sequence calls the larger cost for short prompts (24 layers of 32
prompts of 100 tokens, Zen 4: 310-497 ms against 177-211), and a chunk after a cached prefix
then gets the numbers the whole prompt would have (each row's sums are the same whatever else is
in the batch). Longer chunks take SDPA (or attention/masked.py with a window or soft-cap), where
its blocked matmuls win (one 4,096-token prompt: 5.1 s against ~8).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.attention.backends.torch_ref import TorchAttentionImpl
from pagedllm.attention.metadata import (AttentionMetadata, CommonAttentionInputs, DecodeBatch,
                                         PrefillSeq)

# the longest context a prompt chunk may have to run through the paged kernel (measured one
# 2,048-token prompt at 1.56 s against SDPA's 1.64 for 24 layers, Zen 4; 4,096 loses)
PAGED_PREFILL_MAX_CONTEXT = 2048


@dataclass(frozen=True)
class CpuAttentionMetadata(AttentionMetadata):
    """The common metadata plus the rows the paged kernel computes in a step with prompt chunks:
    paged (decode rows and short prompt chunks' rows as decode rows), paged_rows (their rows of
    the batch, None: rows 0 .. paged.num_tokens - 1), and the prompt chunks left to SDPA."""

    paged: Optional[DecodeBatch] = None
    paged_rows: Optional[torch.Tensor] = None
    long_prefills: tuple[PrefillSeq, ...] = ()


def _paged_batch(dec: Optional[DecodeBatch], short: list[PrefillSeq], block_size: int
                 ) -> tuple[DecodeBatch, Optional[torch.Tensor]]:
    """The step's decode rows and short prompt chunks' rows as one batch of decode rows, and
    their rows of the step's batch (None: rows 0 .. n - 1, in order)."""
    width = max([-(-s.context_len // block_size) for s in short]
                + ([dec.block_table.shape[1]] if dec is not None else []))
    tables, lens, rows = [], [], []
    if dec is not None:
        tables.append(torch.nn.functional.pad(dec.block_table, (0, width - dec.block_table.shape[1])))
        lens.append(dec.context_lens)
        rows.append(torch.arange(dec.num_tokens))
    for s in short:
        ids = torch.nn.functional.pad(s.block_ids, (0, width - s.block_ids.numel()))
        tables.append(ids.expand(s.num_tokens, width))
        # row j of the chunk sits at position context_len - num_tokens + j and sees keys up to it
        lens.append(torch.arange(s.context_len - s.num_tokens + 1, s.context_len + 1))
        rows.append(torch.arange(s.start, s.start + s.num_tokens))
    row_index = torch.cat(rows)
    n = row_index.numel()
    batch = DecodeBatch(n, torch.cat(tables).contiguous(), torch.cat(lens).contiguous())
    in_order = bool(torch.equal(row_index, torch.arange(n)))  # decode rows first, then prompts
    return batch, None if in_order else row_index


class CpuMetadataBuilder:
    """CommonAttentionInputs -> CpuAttentionMetadata: the C++ kernel reads the block table and
    context lengths as they are; a step with prompt chunks also gets its paged batch."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(self, common: CommonAttentionInputs) -> AttentionMetadata:
        """The common inputs, and with short prompt chunks the rows the paged kernel takes."""
        short = [s for s in common.prefills if s.context_len <= PAGED_PREFILL_MAX_CONTEXT]
        if not short:  # decode rows only, or every chunk long: the reference's layout as it is
            return CpuAttentionMetadata(common.slot_mapping, common.decode, common.prefills)
        paged, rows = _paged_batch(common.decode, short, self.block_size)
        long = tuple(s for s in common.prefills if s.context_len > PAGED_PREFILL_MAX_CONTEXT)
        return CpuAttentionMetadata(common.slot_mapping, common.decode, common.prefills,
                                    paged, rows, long)


class CpuAttentionImpl(TorchAttentionImpl):
    """Paged attention through pagedllm's C++ ops (float32 CPU tensors); prompt chunks as in the
    reference."""

    decode_takes_window = decode_takes_softcap = True

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # memcpy per slot: index_copy_ took ~0.6 ms for 512 rows
        torch.ops.pagedllm.write_kv_(kv_cache, k.contiguous(), v.contiguous(), slot_mapping)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        return self._paged(q, kv_cache, meta.decode)

    def _paged(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        return torch.ops.pagedllm.paged_decode_attention(q.contiguous(), kv_cache,
                                                         batch.block_table, batch.context_lens,
                                                         self.scale, self.sliding_window or 0,
                                                         self.softcap or 0.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """As the reference's, but with decode rows and short prompt chunks in one paged call."""
        paged = getattr(meta, "paged", None)
        if paged is None:  # decode only, or metadata from another builder
            return super().forward(q, k, v, kv_cache, meta)
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        rows = meta.paged_rows
        if rows is None and not meta.long_prefills:  # every row is paged, in order
            return self._paged(q, kv_cache, paged)
        out = torch.empty_like(q)
        if rows is None:
            out[:paged.num_tokens] = self._paged(q[:paged.num_tokens], kv_cache, paged)
        else:
            out.index_copy_(0, rows, self._paged(q.index_select(0, rows), kv_cache, paged))
        for seq in meta.long_prefills:
            self._prefill(q, k, v, kv_cache, seq, out)
        return out


class CpuAttentionBackend:
    """The C++ CPU backend (float32 or bf16 KV cache, kernels loaded)."""

    name = "cpu"
    impl_cls = CpuAttentionImpl
    builder_cls = CpuMetadataBuilder
