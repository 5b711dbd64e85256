"""Per-step attention inputs, built once by the model runner's backend builder and read by every
Attention layer through the forward context.

The flattened batch puts decode requests (one query token each) first, then prefill chunks:

    tokens    [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
    decode    rows 0..2, batched in one call through a block table
    prefills  (start=3, len=4, ctx=4), (start=7, len=2, ctx=18)   ctx = computed + scheduled

Block table and slot mapping, block_size 4 (a request's tokens live in its blocks, in order):

    block_ids [7, 2]        positions 0..3 -> block 7, 4..7 -> block 2
    position 5 -> slot 2 * 4 + 1 = 9
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class DecodeBatch:
    """Requests that add exactly one token this step."""

    num_tokens: int                # rows [0, num_tokens) of the flattened batch
    block_table: torch.Tensor      # [B, max_blocks] int64, contiguous, padded with block 0
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
class CommonAttentionInputs:
    """What the runner knows of a step's layout, whatever the backend; builders turn it into
    their own metadata."""

    slot_mapping: torch.Tensor     # [T] int64 slot = block_id * block_size + offset
    decode: Optional[DecodeBatch]
    prefills: list[PrefillSeq]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to."""

    slot_mapping: torch.Tensor     # [T] int64
    decode: Optional[DecodeBatch]
    prefills: list[PrefillSeq]

    @property
    def decode_only(self) -> bool:
        """Every scheduled request adds one token (the captured decode step's case)."""
        return self.decode is not None and not self.prefills


_forward_meta: ContextVar[Optional[AttentionMetadata]] = ContextVar("pagedllm_attn_meta",
                                                                     default=None)


@contextmanager
def set_forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Attention layers called inside read this step's metadata."""
    token = _forward_meta.set(meta)
    try:
        yield
    finally:
        _forward_meta.reset(token)


def get_forward_metadata() -> AttentionMetadata:
    """The metadata of the step being run; an error outside set_forward_context."""
    meta = _forward_meta.get()
    if meta is None:
        raise RuntimeError("attention ran outside set_forward_context(): no step metadata")
    return meta
