"""The default model with its GGUF blocks kept: compact, coherent, as good as float32, the
same alone or batched, and the same through the captured (C++) decode step as through the
model's layer loop, whatever the CPU: dtype 'auto' computes kept-block models in float32, so the
captured step is on with and without native bf16.

Perplexity is measured on the text shipped in pagedllm/eval/data (first 1024 tokens, to keep the
suite fast), through the x8 int8-activation kernels that every batch size uses.
"""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.eval.perplexity import perplexity
from pagedllm.layers.ggml_linear import GGMLEmbedding, GGMLLinear, GGMLMergedLinear
from pagedllm.layers.linear import MergedLinear
from helpers import model_runner

PPL_TOKENS = 1024


@pytest.fixture(scope="module")
def qwen_ppl_float32(qwen_gguf):
    llm = LLM(model=str(qwen_gguf), dtype="float32", quantization="none", max_model_len=2048)
    value = perplexity(llm, max_tokens=PPL_TOKENS)
    del llm
    gc.collect()
    return value


@pytest.fixture(scope="module")
def qwen_blocks(qwen_gguf, qwen_ppl_float32):
    # after the float32 reference is computed and freed: the two models never coexist (the
    # suite's peak memory)
    return LLM(model=str(qwen_gguf), max_model_len=2048)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_default_model_keeps_its_blocks_compact(qwen_blocks, qwen_gguf):
    engine = qwen_blocks.llm_engine
    assert engine.config.quantization == "gguf"
    assert engine.config.dtype == torch.float32  # dtype 'auto' with kept blocks, on any CPU
    # a step's [tokens, 4864] float32 activations stay under glibc's 32 MiB mmap ceiling
    assert engine.config.scheduler.max_num_batched_tokens == 1536
    model = model_runner(qwen_blocks).model
    kinds = {type(m) for m in model.modules()}
    assert {GGMLLinear, GGMLEmbedding, GGMLMergedLinear} <= kinds
    assert not any(isinstance(m, (torch.nn.Linear, MergedLinear)) for m in model.modules())
    # resident weights: the file's blocks plus float32 norms and biases
    assert _weight_bytes(model) <= 1.2 * qwen_gguf.stat().st_size


def test_blocks_are_regrouped_and_decode_runs_in_cpp(qwen_blocks):
    runner = model_runner(qwen_blocks)
    blocks = [m for m in runner.model.modules()
              if isinstance(m, (GGMLLinear, GGMLEmbedding, GGMLMergedLinear))]
    assert all(m.packed for m in blocks)
    assert runner.captured_decode is not None


def _greedy(llm: LLM, prompts: list[str]) -> list[tuple[list[int], float]]:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs]


PROMPTS = ["def quicksort(arr):", "The capital of France is", "Write a haiku about the sea."]


class _CountingStep:
    """The captured decode step, counting its calls (so the comparison cannot pass without it)."""

    def __init__(self, step) -> None:
        self.step, self.calls = step, 0

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


def test_cpp_decode_step_equals_the_python_layers(qwen_blocks):
    runner = model_runner(qwen_blocks)
    captured = runner.captured_decode
    counting = runner.captured_decode = _CountingStep(captured)
    try:
        fused = _greedy(qwen_blocks, PROMPTS)
        runner.captured_decode = None
        python = _greedy(qwen_blocks, PROMPTS)
    finally:
        runner.captured_decode = captured
    # every step after the one that prefills the three prompts is decode-only
    assert counting.calls >= max(len(tokens) for tokens, _ in fused) - 1 > 0
    assert fused == python  # same kernels in the same order: identical logprobs


def test_kept_blocks_give_the_same_tokens_alone_or_batched(qwen_blocks):
    batched = _greedy(qwen_blocks, PROMPTS)
    alone = [_greedy(qwen_blocks, [p])[0] for p in PROMPTS]
    assert [tokens for tokens, _ in batched] == [tokens for tokens, _ in alone]


def test_perplexity_within_two_percent_of_float32(qwen_blocks, qwen_ppl_float32):
    ppl = perplexity(qwen_blocks, max_tokens=PPL_TOKENS)
    assert abs(ppl - qwen_ppl_float32) / qwen_ppl_float32 < 0.02, (ppl, qwen_ppl_float32)


def test_example_prompt_is_coherent(qwen_blocks):
    out = qwen_blocks.chat([{"role": "user", "content": "Write a Python function that checks "
                                                         "whether a number is prime."}],
                           SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    text = out[0].outputs[0].text
    assert "def " in text and "prime" in text.lower(), text


@pytest.fixture(scope="module")
def smollm_float32(smollm_hf_dir) -> tuple[float, int]:
    """SmolLM2's float32 HF checkpoint unquantized: (perplexity, weight bytes), measured once for
    both quantization methods."""
    base = LLM(model=str(smollm_hf_dir), dtype="float32", max_model_len=2048)
    value = perplexity(base, max_tokens=PPL_TOKENS), _weight_bytes(model_runner(base).model)
    del base
    gc.collect()
    return value


@pytest.mark.parametrize("method,bound", [("int8", 0.02), ("int8_g128", 0.02), ("int4", 0.25)])
def test_float_checkpoint_quantized_at_load(smollm_hf_dir, smollm_float32, method, bound):
    ref, dense_bytes = smollm_float32
    llm = LLM(model=str(smollm_hf_dir), dtype="float32", quantization=method, max_model_len=2048,
              max_num_batched_tokens=16)
    assert llm.llm_engine.config.quantization == method
    assert _weight_bytes(model_runner(llm).model) < dense_bytes * (0.3 if method.startswith("int8") else 0.25)
    ppl = perplexity(llm, max_tokens=PPL_TOKENS)
    print(f"SmolLM2-135M {method}: perplexity {ppl:.3f} vs float32 {ref:.3f}")
    assert abs(ppl - ref) / ref < bound, (ppl, ref)


def test_int8_g128_groups_every_matrix_of_the_default_model(qwen_hf_dir, qwen_ppl_float32):
    """quantization="int8_g128" on the default model's HF export (rows of 896 and 4864 values:
    every matrix, the tied embedding and head too, in groups of 128): its perplexity within 2 % of
    float32's, the captured C++ decode step, the same tokens and logprobs alone or batched (a
    batched prompt step of 32 rows and more runs the AMX pass where the CPU has one)."""
    from pagedllm.kernels.types import Q8_0G4

    llm = LLM(model=str(qwen_hf_dir), quantization="int8_g128", max_model_len=2048)
    assert llm.llm_engine.config.quantization == "int8_g128"
    runner = model_runner(llm)
    assert runner.captured_decode is not None, runner.decode_path
    types = {t for m in runner.model.modules()
             for t in ([m.qtype] if hasattr(m, "qtype") else list(getattr(m, "qtypes", ())))}
    assert types == {Q8_0G4}, types
    ppl = perplexity(llm, max_tokens=PPL_TOKENS)
    print(f"default model int8_g128: perplexity {ppl:.3f} vs float32 {qwen_ppl_float32:.3f}")
    assert abs(ppl - qwen_ppl_float32) / qwen_ppl_float32 < 0.02, (ppl, qwen_ppl_float32)
    prompts = [*PROMPTS, "Explain, in three short paragraphs, how a hash map handles two keys that "
                         "land in the same bucket, and what that costs when the table fills up."]
    batched = _greedy(llm, prompts)
    assert batched == [_greedy(llm, [p])[0] for p in prompts]


def test_int8_at_load_on_the_amx_bf16_tiles_keeps_float32s_perplexity(smollm_hf_dir, smollm_float32):
    """PAGEDLLM_KERNEL_ISA=avx512amx_bf16 (asked for only; forced here in-process): int8 at load's
    prompt chunks run on the AMX-BF16 tiles with x in bf16, as good as float32 as the integer
    kernels are."""
    ops = torch.ops.pagedllm
    before = ops.kernel_isa()[0]
    try:
        ops.set_kernel_isa("avx512amx_bf16")
    except RuntimeError as err:
        pytest.skip(str(err).splitlines()[0])
    try:
        llm = LLM(model=str(smollm_hf_dir), dtype="float32", quantization="int8", max_model_len=2048)
        ppl = perplexity(llm, max_tokens=PPL_TOKENS)
        del llm
        gc.collect()
    finally:
        ops.set_kernel_isa(before)
    ref = smollm_float32[0]
    print(f"SmolLM2-135M int8 on the bf16 tiles: perplexity {ppl:.3f} vs float32 {ref:.3f}")
    assert abs(ppl - ref) / ref < 0.02, (ppl, ref)


def test_quantization_choices_are_checked(smollm_gguf, smollm_hf_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=str(smollm_gguf), quantization="fp8")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=str(smollm_gguf), quantization="int8")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=str(smollm_gguf), quantization="int8_g128")
    with pytest.raises(ValueError, match="needs a .gguf"):
        LLM(model=str(smollm_hf_dir), quantization="gguf")
