"""Bidirectional attention for encoders: every token of a sequence sees every other one.

An encoder step holds whole sequences only (the scheduler never splits a pooling request), so
nothing is read from or written to a KV cache. The flattened batch is gathered into a padded
[B, H, L, D] batch once per step; the padded keys are masked out, the padded queries dropped:

    rows      [ a a a | b b | c c c c ]          spans (0, 3), (3, 2), (5, 4)
    padded    a a a . / b b . . / c c c c       key mask: True where a token is
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class EncoderBatch:
    """Where each sequence of the step sits in the flattened rows, as gather indices."""

    index: torch.Tensor  # [B, L] int64 row of each (sequence, offset); padding repeats a row
    valid: torch.Tensor  # [B, L] bool, True where a real token is
    key_mask: torch.Tensor  # [B, 1, 1, L] bool, True = attend

    @classmethod
    def from_spans(cls, spans: list[tuple[int, int]], device: torch.device) -> "EncoderBatch":
        """spans: (first row, tokens) of each sequence, in row order, tiling the batch."""
        lengths = torch.tensor([n for _, n in spans], dtype=torch.int64, device=device)
        starts = torch.tensor([s for s, _ in spans], dtype=torch.int64, device=device)
        offsets = torch.arange(int(lengths.max()), device=device)
        valid = offsets[None, :] < lengths[:, None]  # [B, L]
        index = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
        return cls(index, valid, valid[:, None, None, :])


def encoder_spans(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(first row, tokens) of every sequence in a step: one-token sequences come first (the
    runner's decode rows), then the longer ones; a chunk of a longer sequence is an error."""
    spans = []
    if meta.decode is not None:
        spans += [(row, 1) for row in range(meta.decode.num_tokens)]
    for seq in meta.prefills:
        if seq.context_len != seq.num_tokens:
            raise RuntimeError("an encoder step holds whole sequences only; a sequence was "
                               f"scheduled from token {seq.context_len - seq.num_tokens}")
        spans.append((seq.start, seq.num_tokens))
    return spans


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: EncoderBatch,
                      scale: float) -> torch.Tensor:
    """q, k, v [T, H, D] -> [T, H, D], each sequence attending over all of its own tokens."""
    qb, kb, vb = (t[batch.index].transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=batch.key_mask, scale=scale)
    return out.transpose(1, 2)[batch.valid]  # [T, H, D], rows in order
