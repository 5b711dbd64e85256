"""BlockPool: exact block ids, reference counts and LRU eviction order."""
import pytest

from pagedllm.core.block_hash import hash_block_tokens
from pagedllm.core.block_pool import BlockPool


def test_new_blocks_come_from_the_front_in_id_order():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)


def test_freed_blocks_join_the_back_and_cached_ones_are_evicted_lru():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    ha, hb = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.cache_full_block(a, ha)
    pool.cache_full_block(b, hb)
    pool.free_blocks([b, a, c])  # queue now: 3, b(1), a(0), c(2)
    assert pool.get_cached_block(ha) is a
    got = pool.get_new_blocks(2)
    assert [x.block_id for x in got] == [3, 1]  # b evicted first
    assert pool.get_cached_block(hb) is None and b.block_hash is None
    assert pool.get_cached_block(ha) is a


def test_touch_revives_a_free_cached_block_and_ref_counts():
    pool = BlockPool(2)
    a, _ = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7])
    pool.cache_full_block(a, h)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 0
    pool.free_blocks([a])
    assert pool.num_free_blocks == 0
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1 and pool.get_cached_block(h) is a


def test_chained_hash_depends_on_parent():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3]) == h1


def test_no_caching_pool_never_registers():
    pool = BlockPool(2, enable_caching=False)
    a = pool.get_new_blocks(1)[0]
    pool.cache_full_block(a, hash_block_tokens(None, [1]))
    assert a.block_hash is None
