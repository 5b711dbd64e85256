"""The per-rank layer split of pipeline parallelism: contiguous ranges as vLLM's
get_pp_indices gives them."""
from __future__ import annotations

import pytest

from pagedllm.distributed.stage import (PipelineStage, get_pp_indices, layer_partition,
                                       parse_partition)


def test_layer_split_is_contiguous_as_vllm_splits_it():
    assert [get_pp_indices(24, r, 2) for r in range(2)] == [(0, 12), (12, 24)]
    assert [get_pp_indices(30, r, 2) for r in range(2)] == [(0, 15), (15, 30)]
    # the remainder goes to the stages before the last, as vLLM's get_pp_indices gives it
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [get_pp_indices(5, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert [get_pp_indices(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    assert [get_pp_indices(7, r, 7) for r in range(7)] == [(i, i + 1) for i in range(7)]
    stage = PipelineStage.of_rank(30, 1, 2)
    assert (stage.layers, stage.is_first, stage.is_last) == (range(15, 30), False, True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's 2"):
        get_pp_indices(2, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1, got 2"):
        get_pp_indices(4, 2, 2)


# ---- VLLM_PP_LAYER_PARTITION ---------------------------------------------------------------
def test_partition_variable_sets_the_stages_as_vllm_reads_it(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "16,8")
    assert [get_pp_indices(24, r, 2) for r in range(2)] == [(0, 16), (16, 24)]
    assert PipelineStage.of_rank(24, 1, 2).layers == range(16, 24)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4, 6,6 ,4")  # spaces, as int() takes them
    assert [get_pp_indices(20, r, 4) for r in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]
    assert layer_partition(20, 4) == (4, 6, 6, 4)
    # explicit sizes (the driver's, carried to the ranks) win over the environment
    assert get_pp_indices(20, 1, 2, (10, 10)) == (10, 20)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "  ")  # blank: the even split
    assert layer_partition(24, 2) == (12, 12)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert layer_partition(30, 4) == (7, 8, 8, 7)


@pytest.mark.parametrize("spec, why", [
    ("16;8", r"got '16;8', which is not a list of integers"),
    ("16,8.0", r"got '16,8\.0', which is not a list of integers"),
    ("16,", r"got '16,', which is not a list of integers"),
    ("24", r"got '24': 1 entries for pipeline_parallel_size=2"),
    ("8,8,8", r"got '8,8,8': 3 entries for pipeline_parallel_size=2"),
    ("24,0", r"got '24,0': every stage needs at least one layer"),
    ("26,-2", r"got '26,-2': every stage needs at least one layer"),
    ("16,9", r"got '16,9', which sums to 25"),
])
def test_a_malformed_partition_is_refused_naming_the_variable(monkeypatch, spec, why):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", spec)
    allowed = (r"VLLM_PP_LAYER_PARTITION must be 2 comma-separated layer counts >= 1, one per "
               r"pipeline stage, summing to the model's 24 layers \(e\.g\. 12,12\); ")
    with pytest.raises(ValueError, match=allowed + why):
        get_pp_indices(24, 0, 2)
    with pytest.raises(ValueError, match=allowed + why):
        parse_partition(spec, 24, 2)
