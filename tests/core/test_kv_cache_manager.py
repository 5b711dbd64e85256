"""KVCacheManager: block tables, prefix hits and their limits on a toy cache."""
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(rid, tokens, block_size=4, **params):
    return Request(rid, list(tokens), SamplingParams(**params), 16, frozenset({0}), block_size)


def test_allocation_and_block_table():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("a", range(1, 11))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens still 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", range(1, 11))
    assert not kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [] and kv.pool.num_free_blocks == 2


def test_prefix_hit_full_blocks_only_and_one_token_left():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(1, 10))  # 9 tokens: 2 full blocks hashed
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", list(range(1, 9)) + [99, 98])  # shares the first 8 tokens
    hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 8
    assert kv.allocate_slots(b, 2, hit.blocks)
    assert kv.block_ids("b") == [0, 1, 3]  # free queue: 3..7 then 2, 1, 0 (freed tail first)
    # an exact 8-token prompt may only reuse one block: one token must be computed
    c = make_request("c", range(1, 9))
    assert kv.get_computed_blocks(c).num_tokens == 4


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    reqs = [make_request(str(i), range(10 * i, 10 * i + 7)) for i in range(3)]
    for r in reqs:
        assert kv.allocate_slots(r, 7)
    assert kv.pool.num_free_blocks == 0
    for r in reqs:
        kv.free(r)
    assert kv.pool.num_free_blocks == 6 and kv.usage == 0.0


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(1, 10))
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", range(1, 10), prompt_logprobs=1)
    assert kv.get_computed_blocks(b).num_tokens == 0
