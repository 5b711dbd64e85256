"""Scheduler with several batches in flight (pipeline parallelism's batch queue): requests are
split over the micro-batches, a request in flight is neither scheduled again nor preempted,
and the output of a request aborted in flight is dropped."""
from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

EOS = 0


def make(num_blocks=16, budget=64, max_seqs=4):
    kv = KVCacheManager(num_blocks, 4, True)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(cfg, kv), kv


def req(rid, n_prompt, max_tokens=4, start=1):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(), max_tokens,
                   frozenset({EOS}), 4)


def finish(s, sched, token=5):
    """The update of a batch whose every sampling request drew `token`."""
    sampled = {}
    for rid, n in sched.num_scheduled_tokens.items():
        r = s.requests.get(rid)
        if r is not None and r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = token
    return s.update_from_output(sched, ModelRunnerOutput(sampled=sampled))


def test_requests_are_split_over_the_batches_and_not_scheduled_twice():
    s, _ = make()
    for i in range(4):
        s.add_request(req(str(i), 3, start=10 * i + 1))
    first = s.schedule(2)
    second = s.schedule(2)
    assert list(first.num_scheduled_tokens) == ["0", "1"]
    assert list(second.num_scheduled_tokens) == ["2", "3"]
    assert s.schedule(2).is_empty  # everything is in flight
    assert [o.req_id for o in finish(s, first)] == ["0", "1"]
    third = s.schedule(2)
    assert third.num_scheduled_tokens == {"0": 1, "1": 1}
    assert [o.new_token_ids for o in finish(s, second)] == [[5], [5]]


def test_one_batch_at_a_time_takes_every_request():
    s, _ = make()
    for i in range(4):
        s.add_request(req(str(i), 3, start=10 * i + 1))
    assert len(s.schedule().num_scheduled_tokens) == 4


def test_a_request_in_flight_is_not_preempted():
    # 4 blocks of 4 slots: a and b (8 prompt tokens each) take them all
    s, kv = make(num_blocks=4)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, start=30))
    sched_a, sched_b = s.schedule(2), s.schedule(2)
    assert list(sched_a.num_scheduled_tokens) == ["a"] and list(sched_b.num_scheduled_tokens) == ["b"]
    assert kv.pool.num_free_blocks == 0
    finish(s, sched_a)
    # a needs a third block; b, the newest, is in flight: a itself gives way
    assert s.schedule(2).is_empty
    a = s.waiting[0]
    assert a.request_id == "a" and a.status == RequestStatus.PREEMPTED
    assert a.output_token_ids == [5]
    outs = finish(s, sched_b, token=6)
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("b", [6])]
    assert s.requests["b"].num_computed_tokens == 8


def test_an_abort_in_flight_frees_blocks_at_once_and_drops_the_output():
    s, kv = make()
    s.add_request(req("a", 6))
    sched = s.schedule(2)
    s.abort_requests(["a"])
    assert kv.pool.num_free_blocks == 16 and not s.has_unfinished_requests()
    # the id comes back while the aborted request is still in flight: it waits for that batch
    s.add_request(req("a", 5, start=40))
    blocked = s.schedule(2)
    assert blocked.is_empty and not blocked.finished_req_ids  # kept for a batch that runs
    assert finish(s, sched) == []  # the aborted request's token is dropped
    resumed = s.schedule(2)
    assert [(r.req_id, r.token_ids) for r in resumed.new_reqs] == [("a", list(range(40, 45)))]
    assert resumed.finished_req_ids == {"a"}  # the runner drops the old state, then adds
    assert [o.new_token_ids for o in finish(s, resumed)] == [[5]]
