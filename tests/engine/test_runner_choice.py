"""Which runner a checkpoint gets: runner and vLLM's older task, an encoder pooling and a
decoder generating by default, and a runner the checkpoint cannot serve refused by name."""
from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.runner_choice import choose_runner
from pagedllm.loader.checkpoint import resolve_checkpoint


@pytest.mark.parametrize("kwargs,runner", [
    ({}, "auto"), (dict(task="embed"), "pooling"), (dict(task="generate"), "generate"),
    (dict(runner="pooling", task="embed"), "pooling"), (dict(task="auto"), "auto"),
])
def test_task_folds_into_the_runner(kwargs, runner):
    assert EngineArgs("m", **kwargs).resolved_runner() == runner


@pytest.mark.parametrize("kwargs,message", [
    (dict(task="classify"), "task='classify' is not supported"),
    (dict(task="embed", runner="generate"), "task='embed' means runner='pooling'"),
    (dict(runner="embed"), "runner must be one of auto, generate, pooling"),
])
def test_bad_runner_or_task_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs("m", **kwargs)


def test_an_encoder_pools_and_refuses_to_generate(minilm_dir):
    ckpt = resolve_checkpoint(minilm_dir)
    choice = choose_runner(EngineArgs(str(minilm_dir)), ckpt)
    assert (choice.runner, choice.pooler.pooling_type, choice.max_seq_length) == ("pooling",
                                                                                 "mean", 256)
    assert choose_runner(EngineArgs(str(minilm_dir), task="embed"), ckpt).runner == "pooling"
    with pytest.raises(ValueError, match="runner='generate': bert is an encoder"):
        choose_runner(EngineArgs(str(minilm_dir), runner="generate"), ckpt)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: a bert encoder runs on one"):
        choose_runner(EngineArgs(str(minilm_dir), tensor_parallel_size=2), ckpt)
    with pytest.raises(ValueError, match="quantization='int8' with a bert encoder is not"):
        choose_runner(EngineArgs(str(minilm_dir), quantization="int8"), ckpt)


def test_a_decoder_generates_and_pools_its_last_token_when_asked(smollm_gguf):
    ckpt = resolve_checkpoint(smollm_gguf)
    assert choose_runner(EngineArgs(str(smollm_gguf)), ckpt).runner == "generate"
    pooling = choose_runner(EngineArgs(str(smollm_gguf), task="embed"), ckpt)
    assert pooling.runner == "pooling"
    assert (pooling.pooler.pooling_type, pooling.pooler.normalize) == ("last", True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 with runner='pooling'"):
        choose_runner(EngineArgs(str(smollm_gguf), runner="pooling",
                                 pipeline_parallel_size=2), ckpt)
