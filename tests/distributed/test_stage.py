"""The per-rank layer split of pipeline parallelism: contiguous ranges as vLLM's
get_pp_indices gives them."""
from __future__ import annotations

import pytest

from pagedllm.distributed.stage import PipelineStage, get_pp_indices


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
