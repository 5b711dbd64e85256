"""A shipped model's HF export saved in bf16 (SmolLM2-135M: tests/conftest.py's build_hf_dir,
its float32 tensors rounded to bf16): with dtype="auto" on the CPU it keeps its matrices in bf16
for pagedllm's kernels and decodes through the captured C++ step, with the greedy tokens of
today's path (dtype="float32": the same bf16 values upcast to float32, PyTorch matmuls, a
float32 KV cache; this path's cache is in bf16, as vLLM's) and of its own layer loop."""
from __future__ import annotations

import gc

import pytest
import torch

from helpers import model_runner, save_bf16_export
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels unavailable")

PROMPTS = ["def fibonacci(n):", "The capital of France is"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm_bf16_dir(smollm_hf_dir, tmp_path_factory):
    return save_bf16_export(smollm_hf_dir, tmp_path_factory.mktemp("smollm-bf16"))


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_bf16_export_decodes_on_the_captured_step_with_todays_tokens(smollm_bf16_dir):
    # today's path on a CPU without native bf16 (dtype="auto" gave float32 there)
    upcast = LLM(model=str(smollm_bf16_dir), dtype="float32", max_model_len=512)
    assert upcast.llm_engine.config.quantization == "none"
    today = _tokens(upcast)
    del upcast
    gc.collect()
    llm = LLM(model=str(smollm_bf16_dir), quantization="bf16", max_model_len=512)
    assert llm.llm_engine.config.quantization == "bf16"  # dtype auto's choice without native bf16
    runner = model_runner(llm)
    assert runner.kv_cache.dtype == torch.bfloat16  # kv_cache_dtype "auto" under bf16 weights
    assert runner.captured_decode is not None, runner.decode_path
    through_stack = _tokens(llm)
    assert through_stack == today
    captured, runner.captured_decode = runner.captured_decode, None
    try:
        assert _tokens(llm) == through_stack
    finally:
        runner.captured_decode = captured
