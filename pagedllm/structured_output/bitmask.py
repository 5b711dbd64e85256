"""Token bitmasks: one bit per vocabulary id, 32 ids per int32 word, 1 = allowed.

    row r, id t  ->  word t // 32, bit t % 32 of bitmask[r]
"""
from __future__ import annotations

import torch


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every id allowed."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool, True where the id is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [rows, words, 32]
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits [N, V] of disallowed ids to -inf, in place; bitmask [N, ceil(V / 32)]."""
    logits.masked_fill_(~bitmask_to_bool(bitmask, logits.shape[1]), float("-inf"))
    return logits
