"""Chained hashes of full KV blocks: a block's hash covers every token before it."""
from __future__ import annotations

import hashlib
from array import array
from typing import NewType, Optional, Sequence

BlockHash = NewType("BlockHash", bytes)


def hash_block_tokens(parent: Optional[BlockHash], token_ids: Sequence[int],
                      lora_int_id: Optional[int] = None) -> BlockHash:
    """Hash of one full block given the hash of the block before it (None for the first);
    lora_int_id: the LoRA adapter the keys and values were computed with (None: the base
    model), so that two adapters never share a block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if lora_int_id is not None:
        h.update(b"lora" + array("q", [lora_int_id]).tobytes())
    return BlockHash(h.digest())
