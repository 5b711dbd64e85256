"""Pipeline parallelism across the decoder families: with pipeline_parallel_size=2 (one layer
range per process), the tiny random Gemma 3 (its own decoder, tied head), Phi-3 (fused q/k/v
and gate/up tensors split at load), Qwen3-MoE (experts stacked in the GGUF) and SmolLM3 (NoPE
layers) give the greedy tokens one process gives, from the HF directory and the Q8_0 GGUF,
prompts in chunks with the prefix cache on. The Q8_0 blocks run with 8-bit activations, and
the batches two stages form are not one process's: on an AVX512-VNNI Xeon an activation on a
rounding boundary moved the first log-probabilities by 0.026 and a greedy choice at a near-tie
(0.003 apart) went the other way, so the GGUF is held to the tensor-parallel test's rule."""
from __future__ import annotations

import pytest

from pagedllm import LLM
from test_gemma3 import gemma3  # noqa: F401  (the module's fixtures: the tiny checkpoints)
from test_phi3 import phi3  # noqa: F401
from test_qwen3_moe import qwen3_moe  # noqa: F401
from test_smollm3 import smollm3  # noqa: F401
from test_tensor_parallel_families import _check_tp_against_single, _greedy
from tiny_models import CHUNKED, greedy_tokens

FAMILIES = ["gemma3", "phi3", "qwen3_moe", "smollm3"]


@pytest.mark.parametrize("checkpoint", ["hf_dir", "q8_0_gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_equals_one_process(request, family, checkpoint):
    ckpts = request.getfixturevalue(family)
    # the GGUFs hold no tokenizer: the HF directory's
    engine = dict(model=str(getattr(ckpts, checkpoint)), tokenizer=str(ckpts.hf_dir),
                  dtype="float32", **CHUNKED)
    if checkpoint == "hf_dir":  # float32 throughout: the same tokens
        want = greedy_tokens(LLM(**engine), ckpts.prompts)
        llm = LLM(**engine, pipeline_parallel_size=2)
        try:
            assert greedy_tokens(llm, ckpts.prompts) == want
        finally:
            llm.llm_engine.shutdown()
        return
    want = _greedy(LLM(**engine), ckpts.prompts)
    llm = LLM(**engine, pipeline_parallel_size=2)
    try:  # first log-probabilities within one activation step; tokens but at near-ties
        _check_tp_against_single(_greedy(llm, ckpts.prompts), want)
    finally:
        llm.llm_engine.shutdown()
