"""Per-step attention inputs, built once by the model runner and read by every layer.

The flattened batch puts decode requests (one query token each) first, then prefill chunks:

    tokens    [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
    decode    rows 0..2, batched in one call through a padded block table
    prefills  (start=3, len=4, ctx=4), (start=7, len=2, ctx=18)   ctx = computed + scheduled
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class DecodeBatch:
    """Requests that add exactly one token this step."""

    num_tokens: int                # rows [0, num_tokens) of the flattened batch
    block_table: torch.Tensor      # [B, max_blocks] int64, padded with block 0
    mask: torch.Tensor             # [B, 1, 1, max_blocks * block_size] bool, True = attend
    context_lens: torch.Tensor     # [B] int64 tokens in KV after this step


@dataclass(frozen=True)
class PrefillSeq:
    """A request that adds several tokens (a prompt chunk or a recompute)."""

    start: int                     # first row in the flattened batch
    num_tokens: int
    context_len: int               # tokens in KV after this step, this chunk included
    block_ids: torch.Tensor        # [ceil(context_len / block_size)] int64
    mask: Optional[torch.Tensor]   # [num_tokens, context_len] bool; None = plain causal from 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to."""

    slot_mapping: torch.Tensor     # [T] int64 slot index = block_id * block_size + offset
    decode: Optional[DecodeBatch]
    prefills: list[PrefillSeq]
