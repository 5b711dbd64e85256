"""Scheduler: token budget, chunked prefill, joining mid-flight, preemption, stop conditions."""
from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

EOS = 0


def make(num_blocks=16, block_size=4, budget=8, max_seqs=4, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(cfg, kv), kv


def req(rid, n_prompt, max_tokens=4, block_size=4, start=1, **params):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(**params),
                   max_tokens, frozenset({EOS}), block_size)


def run_step(s, token=5):
    sched = s.schedule()
    sampled = {}
    for rid, n in sched.num_scheduled_tokens.items():
        r = s.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = token
    return sched, s.update_from_output(sched, ModelRunnerOutput(sampled=sampled))


def test_long_prompt_is_chunked_by_the_budget():
    s, _ = make(budget=8)
    s.add_request(req("a", 20))
    sched, outs = run_step(s)
    assert sched.num_scheduled_tokens == {"a": 8} and outs == []
    sched, _ = run_step(s)
    assert sched.num_scheduled_tokens == {"a": 8}
    sched, outs = run_step(s)
    assert sched.num_scheduled_tokens == {"a": 4}
    assert outs[0].new_token_ids == [5]


def test_new_requests_join_a_running_batch():
    s, _ = make(budget=16)
    s.add_request(req("a", 6))
    run_step(s)
    s.add_request(req("b", 5, start=50))
    sched, _ = run_step(s)
    assert sched.num_scheduled_tokens == {"a": 1, "b": 5}
    assert [r.req_id for r in sched.new_reqs] == ["b"]
    assert [r.req_id for r in sched.cached_reqs] == ["a"]


def test_finished_requests_leave_at_once_and_free_blocks():
    s, kv = make(budget=16)
    s.add_request(req("a", 6, max_tokens=2))
    run_step(s)
    _, outs = run_step(s)
    assert outs[0].finish_reason == "length"
    assert not s.has_unfinished_requests() and kv.pool.num_free_blocks == 16
    sched = s.schedule()
    assert sched.finished_req_ids == {"a"} and sched.is_empty


def test_eos_stop_token_and_min_tokens():
    s, _ = make(budget=16)
    s.add_request(req("a", 3, max_tokens=10, min_tokens=2))
    _, outs = run_step(s, token=EOS)
    assert outs[0].finish_reason is None  # min_tokens not reached
    _, outs = run_step(s, token=EOS)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason is None
    s.add_request(req("b", 3, stop_token_ids=[7]))
    _, outs = run_step(s, token=7)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 7
    s.add_request(req("c", 3, ignore_eos=True, max_tokens=2))
    _, outs = run_step(s, token=EOS)
    assert outs[0].finish_reason is None


def test_preemption_recomputes_the_newest_request():
    # 4 blocks of 4 slots; two requests of 8 prompt tokens take 2 blocks each
    s, kv = make(num_blocks=4, budget=32)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, start=30))
    run_step(s)  # both prefilled: 8 prompt tokens each, all 4 blocks used
    assert kv.pool.num_free_blocks == 0
    sched, _ = run_step(s)  # a needs a 3rd block -> b preempted
    assert sched.num_scheduled_tokens == {"a": 1}
    b = [r for r in s.waiting][0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.output_token_ids == [5]
    # a finishes, then b resumes with prompt + its output recomputed
    while "a" in s.requests:
        run_step(s)
    sched, _ = run_step(s)
    new = sched.new_reqs[0]
    assert new.req_id == "b" and new.token_ids == list(range(30, 38)) + [5]


def test_max_num_seqs_limits_admission():
    s, _ = make(budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 3, start=10 * i + 1))
    sched, _ = run_step(s)
    assert set(sched.num_scheduled_tokens) == {"0", "1"}


def test_prefix_hit_at_admission():
    s, _ = make(budget=64)
    s.add_request(req("a", 9, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 9, max_tokens=1))
    sched, _ = run_step(s)
    assert sched.num_scheduled_tokens == {"b": 1}
    assert sched.new_reqs[0].num_computed_tokens == 8


def test_abort_frees_blocks():
    s, kv = make()
    s.add_request(req("a", 6))
    run_step(s)
    s.abort_requests(["a"])
    assert kv.pool.num_free_blocks == 16 and not s.has_unfinished_requests()


def test_at_most_max_loras_adapters_run_at_once_and_the_others_keep_their_place():
    from pagedllm.lora.request import LoRARequest
    kv = KVCacheManager(32, 4, True)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                          max_loras=1)
    s = Scheduler(cfg, kv)
    one, two = LoRARequest("one", 1, "/a/1"), LoRARequest("two", 2, "/a/2")
    for rid, lora in [("a", one), ("b", two), ("c", None), ("d", one), ("e", two)]:
        r = req(rid, 3, max_tokens=2)
        r.lora_request = lora
        s.add_request(r)
    sched, _ = run_step(s)
    assert list(sched.num_scheduled_tokens) == ["a", "c", "d"]  # adapter two waits for a slot
    assert [r.lora_request for r in sched.new_reqs] == [one, None, one]
    assert [r.request_id for r in s.waiting] == ["b", "e"]
    run_step(s)  # a, c, d finish
    sched, _ = run_step(s)
    assert list(sched.num_scheduled_tokens) == ["b", "e"]


def test_the_prefix_cache_keys_blocks_by_adapter():
    from pagedllm.lora.request import LoRARequest
    base, same, other = req("x", 8), req("y", 8), req("z", 8)
    with_one = Request("w", list(range(1, 9)), SamplingParams(), 4, frozenset({EOS}), 4,
                       lora_request=LoRARequest("one", 1, "/a/1"))
    with_two = Request("v", list(range(1, 9)), SamplingParams(), 4, frozenset({EOS}), 4,
                       lora_request=LoRARequest("two", 2, "/a/2"))
    assert base.block_hashes == same.block_hashes == other.block_hashes
    hashes = [base.block_hashes, with_one.block_hashes, with_two.block_hashes]
    assert all(len(h) == 2 for h in hashes)
    assert len({h for hs in hashes for h in hs}) == 6  # no block shared across adapters
