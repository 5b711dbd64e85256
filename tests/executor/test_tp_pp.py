"""Tensor parallelism combined with pipeline parallelism (tensor_parallel_size=2 x
pipeline_parallel_size=2: four local processes, the "mp" executor) on the shipped Qwen model.

The ranks sit as vLLM lays them out: global rank = stage x 2 + TP rank, each stage's two TP
ranks joined in a TP group of their own, each TP rank sending the residual stream to the same
TP rank of the next stage, TP rank 0 of the last stage (rank 2) sampling. Each rank holds its
TP share of its stage's layers: the same shards, summed by the same all-reduce over two ranks,
as tensor_parallel_size=2 alone, so the greedy tokens equal TP=2's exactly; and TP=2's equal
one process's (tests/executor/test_tensor_parallel.py). Four ranks on this machine's cores
are slow: two short prompts, eight tokens.
"""
from __future__ import annotations

import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.distributed.parallel_groups import tp_group_ranks
from pagedllm.executor.abstract import WorkerDiedError
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.rank_places import places_driver, rank_places
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.worker.stage_comm import peer_rank
from rank_helpers import gone, kill_mid_generation

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=2)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _run(model: str, **parallel) -> list[list[int]]:
    llm = LLM(model=model, **ENGINE, **parallel)
    try:
        return _tokens(llm)
    finally:
        llm.llm_engine.shutdown()


# ---- layout ----------------------------------------------------------------------------------
def test_tp2_pp2_ranks_groups_peers_and_driver(qwen_gguf):
    """Qwen's 24 layers over 2 stages of 2 TP ranks: ranks 0, 1 hold layers 0-11, ranks 2, 3
    layers 12-23; TP groups [0, 1] and [2, 3]; rank 0 sends to rank 2, rank 1 to rank 3;
    rank 2 samples."""
    config = EngineConfig(model_path=str(qwen_gguf), arch=resolve_checkpoint(qwen_gguf).arch,
                          dtype=torch.float32, platform=CpuPlatform(),
                          parallel=ParallelConfig(tensor_parallel_size=2,
                                                  pipeline_parallel_size=2))
    places = rank_places(config)
    assert [(p.rank, p.world_size, p.stage.rank, p.tp.rank) for p in places] == [
        (0, 4, 0, 0), (1, 4, 0, 1), (2, 4, 1, 0), (3, 4, 1, 1)]
    assert [(p.stage.start_layer, p.stage.end_layer) for p in places] == [(0, 12)] * 2 + [
        (12, 24)] * 2
    assert {p.tp.world_size for p in places} == {2}
    assert places[2].name == "pipeline stage 1, tensor parallel rank 0 (rank 2)"
    assert [tp_group_ranks(s, 2) for s in range(2)] == [[0, 1], [2, 3]]
    assert [peer_rank(p.stage, p.tp, +1) for p in places[:2]] == [2, 3]
    assert [peer_rank(p.stage, p.tp, -1) for p in places[2:]] == [0, 1]
    assert places_driver(places) == 2


def test_tp_alone_and_pp_alone_keep_their_layouts(qwen_gguf):
    arch = resolve_checkpoint(qwen_gguf).arch
    for tp, pp, driver, names in ((2, 1, 0, ["tensor parallel rank 0", "tensor parallel rank 1"]),
                                  (1, 2, 1, ["pipeline rank 0", "pipeline rank 1"])):
        config = EngineConfig(model_path=str(qwen_gguf), arch=arch, dtype=torch.float32,
                              platform=CpuPlatform(),
                              parallel=ParallelConfig(tensor_parallel_size=tp,
                                                      pipeline_parallel_size=pp))
        places = rank_places(config)
        assert [p.name for p in places] == names
        assert places_driver(places) == driver


# ---- equal to TP=2 alone ---------------------------------------------------------------------
def test_qwen_hf_dir_tp2_pp2_equals_tp2_and_one_process(qwen_hf_dir):
    """float32: TP=2 x PP=2 gives TP=2's greedy tokens exactly, and one process's."""
    want = _run(str(qwen_hf_dir))
    tp2 = _run(str(qwen_hf_dir), tensor_parallel_size=2)
    llm = LLM(model=str(qwen_hf_dir), tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert isinstance(executor, MultiprocExecutor) and len(executor.worker_pids) == 4
        assert "tensor parallel rank 0 of 2" in executor.decode_path()
        llm.llm_engine.rank_comm_stats(reset=True)
        got = _tokens(llm)
        stats = llm.llm_engine.rank_comm_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == tp2
    assert got == want
    # stage 0's TP ranks send (one tensor a step each), stage 1's receive; every rank
    # all-reduces twice a layer of its 12, stage 0 once more for the embedding
    steps = stats[0]["forwards"]
    assert steps > 0 and stats[1]["forwards"] == steps
    assert [s["sends"] for s in stats] == [steps, steps, 0, 0]
    assert [s["recvs"] for s in stats] == [0, 0, steps, steps]
    assert [s["all_reduces"] for s in stats] == [25 * steps] * 2 + [24 * steps] * 2
    assert [s["all_gathers"] > 0 for s in stats] == [False, False, True, True]


# ---- failure ---------------------------------------------------------------------------------
def test_a_killed_rank_of_tp2_pp2_fails_generate_with_its_rank_named(qwen_hf_dir):
    """Rank 1 (stage 0, TP rank 1) killed mid-generation: generate fails naming it, no hang,
    every rank's process gone."""
    llm = LLM(model=str(qwen_hf_dir), tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    pids = llm.llm_engine.engine_core.executor.worker_pids
    try:
        err = kill_mid_generation(llm, PROMPTS, pids[1], max_tokens=100)
        assert isinstance(err, WorkerDiedError), err
        assert "pipeline stage 0, tensor parallel rank 1 (rank 1)" in str(err)
        assert "killed by signal 9" in str(err)
        deadline = time.monotonic() + 30
        while not gone(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pids)
        with pytest.raises(WorkerDiedError, match="tensor parallel rank 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_qwen_gguf_kept_blocks_tp2_pp2_equals_tp2(qwen_gguf):
    """The default quantization, K-quant blocks kept: down_proj's 19 blocks a row split 10/9
    on every stage's layers as TP=2 splits them; the same parts and all-reduces give TP=2's
    greedy tokens exactly (TP=2 against one process: tests/executor/test_tensor_parallel.py)."""
    tp2 = _run(str(qwen_gguf), tensor_parallel_size=2)
    assert _run(str(qwen_gguf), tensor_parallel_size=2, pipeline_parallel_size=2) == tp2
