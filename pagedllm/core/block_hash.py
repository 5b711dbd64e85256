"""Chained hashes of full KV blocks: a block's hash covers every token before it."""
from __future__ import annotations

import hashlib
from array import array
from typing import NewType, Optional, Sequence

BlockHash = NewType("BlockHash", bytes)


def hash_block_tokens(parent: Optional[BlockHash], token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())
