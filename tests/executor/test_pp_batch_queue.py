"""Pipeline parallelism with several batches in flight (EngineCore's batch queue, the "mp"
executor, pipeline_parallel_size=2): with requests of different lengths finishing at different
times, greedy and seeded tokens equal the single process's while two batches really were in
flight at once; a request aborted in flight yields nothing more and frees its blocks; a rank
killed with two batches in flight fails the engine at once, leaving no process."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.abstract import WorkerDiedError
from pagedllm.executor.uniproc import UniProcExecutor
from rank_helpers import DEADLINE_S, gone

# 8 prompts of 8 to 57 tokens; max_tokens 6 to 27, one seeded sample: they finish apart. They
# differ in their first block, so no prompt takes another's blocks from the prefix cache: KV
# computed in another chunk differs in the last bits, and with these repetitive prompts that
# flips near-ties (a 0.02 logprob gap) between one process's schedule and PP=2's, on main too
PROMPTS = [f"Story {i}: " + "word " * (3 + 7 * i) + "and then" for i in range(8)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]
PARAMS[2] = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=8)
# no block in common with PROMPTS or each other: no prefix cache hit
ABORT_PROMPTS = [f"Item {i}: " + "apple " * (2 + 5 * i) + "and then" for i in range(4)]
ABORT_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# for the drained run: prompts the engine has not seen (a cache hit changes the last bits)
DRAIN_PROMPTS = [f"Note {i}: " + "pear " * (2 + 4 * i) + "so" for i in range(4)]


def _tokens(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def single_tokens(smollm_gguf) -> dict[str, list[list[int]]]:
    """One process's tokens (one step at a time, as before): PROMPTS, ABORT_PROMPTS,
    DRAIN_PROMPTS."""
    llm = LLM(model=str(smollm_gguf), **ENGINE)
    assert isinstance(llm.llm_engine.engine_core.executor, UniProcExecutor)
    assert llm.llm_engine.engine_core.batch_queue is None
    return {"many": _tokens(llm), "abort": _tokens(llm, ABORT_PROMPTS, ABORT_PARAMS),
            "drain": _tokens(llm, DRAIN_PROMPTS, ABORT_PARAMS)}


@pytest.fixture(scope="module")
def pp_llm(smollm_gguf) -> LLM:
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_two_batches_in_flight_equal_one_process(pp_llm, single_tokens):
    core = pp_llm.llm_engine.engine_core
    assert core.executor.max_concurrent_batches == 2
    assert _tokens(pp_llm) == single_tokens["many"]
    assert core.max_batches_in_flight == 2
    assert not core.has_unfinished_requests() and core.kv_manager.usage == 0


def test_an_abort_in_flight_yields_nothing_more_and_frees_its_blocks(pp_llm, single_tokens):
    """Requests go to the engine core itself, so that what it outputs is seen unfiltered."""
    engine = pp_llm.llm_engine
    core = engine.engine_core
    ids = [f"abort-{i}" for i in range(len(ABORT_PROMPTS))]
    for request_id, prompt in zip(ids, ABORT_PROMPTS):
        for request in engine.input_processor.process(request_id, prompt, ABORT_PARAMS).requests:
            core.add_request(request)
    while len(core.batch_queue) < 2:
        assert core.step() == []  # two batches of two requests submitted
    victim = next(iter(core.batch_queue[0][0].num_scheduled_tokens))
    core.abort_requests([victim])
    outputs: dict[str, list[int]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        for out in core.step():
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert not core.has_unfinished_requests() and not core.batch_queue
    want = dict(zip(ids, single_tokens["abort"]))
    del want[victim]
    assert outputs == want  # nothing more for the victim; the others as one process
    assert core.kv_manager.usage == 0


def test_a_big_call_waits_for_the_replies_before_it(pp_llm, single_tokens, monkeypatch):
    """Every call counted big: each step is sent only once the ranks answered the steps before
    (what keeps a large SchedulerOutput and a large reply from blocking each other's pipe);
    the tokens stay the same."""
    from pagedllm.executor import multiproc

    monkeypatch.setattr(multiproc, "BIG_CALL_BYTES", 0)
    executor = pp_llm.llm_engine.engine_core.executor
    waits = []
    steps = executor._steps
    drain = steps.drain
    monkeypatch.setattr(steps, "drain", lambda: waits.append(len(steps)) or drain())
    assert _tokens(pp_llm, DRAIN_PROMPTS, ABORT_PARAMS) == single_tokens["drain"]
    assert max(waits) == 1  # a step was in flight when the next was sent: it was read first


@pytest.mark.parametrize("killed", [0, 1])
def test_a_rank_killed_with_two_batches_in_flight_fails_at_once(smollm_gguf, killed):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf),
                                                   pipeline_parallel_size=2, **ENGINE))
    core = engine.engine_core
    pids = core.executor.worker_pids
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, long)
        while len(core.batch_queue) < 2:
            assert core.step() == []
        os.kill(pids[killed], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"pipeline rank {killed}.*killed by signal 9"):
            while time.monotonic() - started < DEADLINE_S:
                core.step()
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerDiedError, match=f"pipeline rank {killed}"):
            core.step()  # it stays failed
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 30
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids)
