"""Tensor parallelism of Phi-3's fused tensors and of MoE blocks, on tiny random models at
tensor_parallel_size=2 against one process (the rules of test_tensor_parallel_families.py:
float32 HF directory, the same greedy tokens and log-probabilities within 1e-3; Q8_0 GGUF,
within 0.02 and the same tokens but at the one process's near-ties).

- Phi-3: each rank reads its rows of each shard of the fused qkv_proj / gate_up_proj (several
  row ranges of one tensor; from the GGUF, whole rows of blocks of attn_qkv and ffn_up).
- Qwen2-MoE: every expert on both ranks, its intermediate rows split (experts' 64 and the
  shared expert's 96 split into Q8_0 blocks of 32: 64/32 rows, unevenly), the router and the
  shared expert's gate replicated; the GGUF's stacked experts read per expert, down_exps by
  each rank's blocks of every row. One all-reduce a MoE block, counted.
- Qwen3-MoE (its tiny model of test_qwen3_moe.py, renormalised top-k) from the HF directory
  and the float32 GGUF.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM
from test_phi3 import phi3  # noqa: F401  (the module's fixture: the tiny checkpoints)
from test_qwen2_moe import tiny_qwen2_moe
from test_qwen3_moe import qwen3_moe  # noqa: F401
from test_tensor_parallel_families import (BLOCKS_LOGPROB_TOL, LOGPROB_TOL,
                                           _check_tp_against_single, _greedy, _single_and_tp2)
from tiny_models import CHUNKED

LAYERS = 2  # tiny_qwen2_moe's and qwen3_moe's


@pytest.fixture(scope="module")
def qwen2_moe_tp(tmp_path_factory):
    """A tiny Qwen2-MoE whose experts split over two ranks in Q8_0 blocks: 8 experts of 64
    intermediate rows (two blocks of 32 in each down_proj row), 2 chosen per token, a shared
    expert of 96 (three blocks)."""
    return tiny_qwen2_moe(tmp_path_factory, "qwen2_moe_tp", 64, (5, 23, 40))


def _engine(ckpts, checkpoint: str) -> dict:
    # the GGUFs hold no tokenizer: the HF directory's
    return dict(model=str(getattr(ckpts, checkpoint)), tokenizer=str(ckpts.hf_dir),
                dtype="float32", **CHUNKED)


def _check(got: list, want: list, checkpoint: str) -> None:
    if checkpoint != "q8_0_gguf":  # float32 throughout: the same tokens, logprobs within 1e-3
        assert [g[0] for g in got] == [w[0] for w in want]
    _check_tp_against_single(got, want, BLOCKS_LOGPROB_TOL if checkpoint == "q8_0_gguf" else
                             LOGPROB_TOL)


@pytest.mark.parametrize("checkpoint", ["hf_dir", "q8_0_gguf"])
def test_phi3_fused_tensors_tp2_equals_one_process(phi3, checkpoint):  # noqa: F811
    want, got = _single_and_tp2(_engine(phi3, checkpoint), phi3.prompts[:2])
    _check(got, want, checkpoint)


@pytest.mark.parametrize("family, checkpoint", [
    ("qwen2_moe_tp", "hf_dir"), ("qwen2_moe_tp", "q8_0_gguf"),
    # renormalised top-k; experts of 32 rows split 16/16 (float32 GGUF: each expert's rows of
    # the stacked tensors, then its down_proj's columns)
    ("qwen3_moe", "hf_dir"), ("qwen3_moe", "f32_gguf"),
])
def test_moe_tp2_equals_one_process_with_one_all_reduce_a_block(request, family, checkpoint):
    ckpts = request.getfixturevalue(family)
    engine = _engine(ckpts, checkpoint)
    want = _greedy(LLM(**engine), ckpts.prompts)
    llm = LLM(**engine, tensor_parallel_size=2)
    try:
        llm.llm_engine.rank_comm_stats(reset=True)
        got = _greedy(llm, ckpts.prompts)
        stats = llm.llm_engine.rank_comm_stats()
    finally:
        llm.llm_engine.shutdown()
    _check(got, want, checkpoint)
    # a step: the embedding's all-reduce, then each layer's attention and MoE block (one each,
    # not one per expert)
    steps = stats[0]["forwards"]
    assert steps > 0 and stats[1]["forwards"] == steps
    assert [s["all_reduces"] for s in stats] == [(1 + 2 * LAYERS) * steps] * 2
