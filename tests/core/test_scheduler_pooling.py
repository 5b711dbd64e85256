"""Scheduler with pooling requests: whole prompts only, packed up to the token budget, finished
(blocks freed, nothing sampled) in the update of their one step."""
import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


def make(budget=16, max_seqs=8, num_blocks=32, block_size=4):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=16)
    return Scheduler(cfg, kv), kv


def pooling_req(rid, n, start=1, block_size=4):
    return Request(rid, list(range(start, start + n)), SamplingParams(), 0, frozenset(),
                   block_size, pooling_params=PoolingParams())


def pooled_step(s):
    """One step whose runner pools every scheduled request (a vector naming its length)."""
    sched = s.schedule()
    pooled = {rid: [float(n)] for rid, n in sched.num_scheduled_tokens.items()}
    return sched, s.update_from_output(sched, ModelRunnerOutput(sampled={}, pooled=pooled))


def test_whole_prompts_are_packed_up_to_the_budget_and_never_split():
    s, _ = make(budget=16)
    for rid, n in (("a", 5), ("b", 6), ("c", 7), ("d", 3)):
        s.add_request(pooling_req(rid, n))
    sched, outs = pooled_step(s)
    # c (7) does not fit the 5 tokens left: it waits, whole, and d behind it too (FIFO)
    assert sched.num_scheduled_tokens == {"a": 5, "b": 6}
    assert [(o.req_id, o.pooled, o.finish_reason, o.new_token_ids) for o in outs] == [
        ("a", [5.0], "stop", []), ("b", [6.0], "stop", [])]
    sched, outs = pooled_step(s)
    assert sched.num_scheduled_tokens == {"c": 7, "d": 3}
    assert not s.has_unfinished_requests()


def test_no_blocks_are_kept_after_the_step_and_none_are_cached():
    s, kv = make()
    s.add_request(pooling_req("a", 8))
    s.add_request(pooling_req("b", 8))  # the same tokens: no prefix-cache hit for an encoder
    sched = s.schedule()
    assert sched.new_reqs[0].pooling_params is not None
    assert all(r.num_computed_tokens == 0 for r in sched.new_reqs)
    assert kv.usage > 0
    s.update_from_output(sched, ModelRunnerOutput(sampled={}, pooled={"a": [1.0], "b": [2.0]}))
    assert kv.usage == 0 and s.requests == {} and s.running == []
    assert sched.finished_req_ids == set()
    assert s.schedule().finished_req_ids == {"a", "b"}  # the runner drops their state next step


def test_a_missing_pooled_output_fails_that_request_alone():
    s, kv = make()
    s.add_request(pooling_req("a", 4))
    s.add_request(pooling_req("b", 4, start=9))
    sched = s.schedule()
    outs = s.update_from_output(sched, ModelRunnerOutput(sampled={}, pooled={"b": [1.0]}))
    by_id = {o.req_id: o for o in outs}
    assert by_id["a"].finish_reason == "error" and "no pooled output" in by_id["a"].error
    assert by_id["b"].pooled == [1.0] and kv.usage == 0


@pytest.mark.parametrize("n", [1, 16])
def test_a_one_token_and_a_budget_long_prompt_run(n):
    s, _ = make(budget=16)
    s.add_request(pooling_req("a", n))
    sched, outs = pooled_step(s)
    assert sched.num_scheduled_tokens == {"a": n} and outs[0].pooled == [float(n)]
    assert RequestStatus.FINISHED_STOPPED.finish_reason == outs[0].finish_reason
