"""The pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache map.

A block is in exactly one of two states:
  in use   ref_cnt > 0, not in the free queue
  free     ref_cnt == 0, in the free queue; it may still hold a cached prefix (block_hash set)
           until it is handed out again, which evicts it from the cache.

    free queue (OrderedDict, O(1) push/pop/remove)
    front = evicted first                       back = most recently freed
    [ b7 | b3 | b12 | ... | b5 ]
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from pagedllm.core.block_hash import BlockHash


@dataclass(eq=False)
class KVBlock:
    """One fixed-size block of KV slots."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None


class BlockPool:
    """Hands out free blocks, takes them back, and remembers full blocks by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-free ones included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVBlock]:
        """The block holding this prefix hash, if it is still cached."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling them out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop n blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue in order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block whose slots are all filled under its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # same content computed twice concurrently; keep the first copy
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
