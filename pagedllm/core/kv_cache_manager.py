"""Blocks per request: prefix-cache lookups, slot allocation and release.

A request's block table maps token positions to KV slots:

    positions   0..15   16..31   32..47  48..
    blocks      [ 4 ]   [ 9 ]    [ 2 ]   [ 11 ]      block_size = 16
    slot(pos) = blocks[pos // 16] * 16 + pos % 16
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class ComputedBlocks(NamedTuple):
    """Prefix-cache hit for a waiting request."""

    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    """Owns each request's block list on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # blocks of the request already registered in the cache
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request.

        At least one token is always left to compute so that the step yields logits.
        """
        if not (self.enable_caching and request.uses_prefix_cache):
            return ComputedBlocks([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: Sequence[KVBlock] = ()) -> bool:
        """Reserve blocks for num_new_tokens more tokens; False (and no change) if they don't fit."""
        blocks = self._req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        total = num_computed + num_new_tokens
        num_required = cdiv(total, self.block_size) - len(blocks) - len(new_computed)
        # cache hits sitting in the free queue are taken out of it by touch()
        num_free_hits = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_required > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self._req_blocks[request.request_id]
            return False
        if new_computed:
            self.pool.touch(new_computed)
            blocks.extend(new_computed)
        if num_required > 0:
            blocks.extend(self.pool.get_new_blocks(num_required))
        self._cache_full_blocks(request, blocks, total)
        return True

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether allocate_slots(request, num_new_tokens) would succeed now (a running
        request: no new cache hits)."""
        blocks = self._req_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        return cdiv(total, self.block_size) - len(blocks) <= self.pool.num_free_blocks

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so that shared prefixes are evicted last."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """Block table of a request."""
        return [b.block_id for b in self._req_blocks.get(request_id, [])]

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        if not (self.enable_caching and request.uses_prefix_cache):
            return
        start = self._num_hashed.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_hashed[request.request_id] = max(start, num_full)
