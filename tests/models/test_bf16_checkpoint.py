"""A bf16 HF checkpoint on the CPU (quantization="bf16", its default with dtype="auto"): every
matrix kept in bf16 in the x8 layout (csrc/x8_bf16.cpp), computed in float32, through the
captured C++ decode step; against transformers in float32 on the very bf16 values, and against
today's path (quantization="none": the weights upcast to float32), on tiny random Qwen2 (q/k/v
biases, tied head) and Llama (untied head) models.

Those comparisons hold to 1e-4 for the kernels that keep x in float32 (avx512f, avx2, scalar),
which the module forces; the ones that round x to bf16 (amx, avx512bf16: vdpbf16ps and the AMX
tiles take bf16 operands) are held to the error of that rounding on their own
(test_the_bf16_x_variants)."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from e2e.helpers import last_logits, model_runner
from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels import bf16_kernel, kernels_available
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.memory.weight_layout import planned_weight_layout
from pagedllm.layers.ggml_linear import BF16, GGMLEmbedding, GGMLLinear, GGMLMergedLinear
from tiny_models import (VOCAB, check_captured_equals_loop, greedy_tokens, hf_reference,
                         max_logit_error, prompts, random_init, save_hf_dir)

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels unavailable")

OPTS = dict(max_model_len=256, max_num_batched_tokens=64, block_size=16)
BF16_X = ("amx", "avx512bf16")  # the variants that round x to bf16
BF16_KV_ERROR = 1e-4  # K/V rounded to bf16: 5.8e-6 (qwen2) and 7.9e-6 (llama) measured on a Zen 4


@pytest.fixture(scope="module", autouse=True)
def float32_x_variant():
    """The best variant this CPU runs that keeps x in float32, for the module (restored after)."""
    chosen = bf16_kernel()
    torch.ops.pagedllm.set_bf16_kernel(next(v for v in chosen.runnable if v not in BF16_X))
    yield
    torch.ops.pagedllm.set_bf16_kernel(chosen.name)


def _tiny(kind: str):
    if kind == "qwen2":
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=True)
        return Qwen2ForCausalLM(cfg)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def bf16_ckpt(request, tmp_path_factory):
    """(HF dir saved in bf16, transformers' float32 reference on those bf16 values, prompts)."""
    model = _tiny(request.param).eval()
    random_init(model, seed=3, scale=0.2)
    with torch.no_grad():  # the parameters only: model.to(bfloat16) would round RoPE's buffer too
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    saved = copy.deepcopy(model).to(torch.bfloat16)
    hf_dir = save_hf_dir(saved, tmp_path_factory.mktemp(f"bf16-{request.param}") / "hf")
    token_prompts = prompts((5, 23, 40), seed=2)
    return hf_dir, hf_reference(model, token_prompts, num_tokens=16), token_prompts


@pytest.fixture(scope="module")
def auto_llm(bf16_ckpt):
    """The bf16 matrices asked for: dtype="auto"'s choice (test_the_default_follows_the_cpu),
    with a float32 KV cache, so that the comparisons below hold the matrices' kernels alone
    (the default cache, in bf16: test_the_default_kv_cache_is_bf16)."""
    return LLM(model=str(bf16_ckpt[0]), quantization="bf16", kv_cache_dtype="float32", **OPTS)


@pytest.mark.parametrize("features,default", [
    (("avx2",), "bf16"),  # Zen 3: the alternative is the float32 upcast
    (("avx2", "avx512f", "avx512_bf16"), "bf16"),  # Zen 4/5: vdpbf16ps blocks beat torch's bf16
    (("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "bf16")])  # Xeon with AMX
def test_the_default_follows_the_cpu(bf16_ckpt, features, default):
    """dtype="auto" on a bf16 checkpoint: the bf16 matrices on every CPU (each CPU handed in, so
    every machine tests all three)."""
    from pagedllm.engine import config_builder
    from pagedllm.platforms.cpu import CpuInfo

    ckpt = resolve_checkpoint(str(bf16_ckpt[0]))
    platform = CpuPlatform(CpuInfo("test cpu", features, 2, "test"))
    chosen = config_builder.resolve_quantization(EngineArgs(str(bf16_ckpt[0])), ckpt, platform,
                                                 build_kernels=False)
    assert chosen == default


def test_auto_keeps_bf16_matrices_and_runs_the_captured_step(bf16_ckpt, auto_llm):
    config = auto_llm.llm_engine.config
    assert (config.quantization, config.dtype) == ("bf16", torch.float32)
    runner = model_runner(auto_llm)
    assert runner.captured_decode is not None, runner.decode_path
    mats = [m for m in runner.model.modules()
            if isinstance(m, (GGMLLinear, GGMLEmbedding, GGMLMergedLinear))]
    assert mats and all(m.packed for m in mats)
    assert {t for m in mats for t in getattr(m, "qtypes", (getattr(m, "qtype", None),))} == {BF16}
    assert not any(isinstance(m, torch.nn.Linear) for m in runner.model.modules())
    # half of float32: every matrix at 2 bytes a value (norms and biases stay float32)
    with safe_open(str(bf16_ckpt[0] / "model.safetensors"), framework="pt") as f:
        values = sum(f.get_slice(n).get_shape()[0] * max(1, (f.get_slice(n).get_shape() + [1])[1])
                     for n in f.keys())
    held = sum(p.nbytes for p in runner.model.parameters())  # a tied head's weight counted once
    assert held < 0.52 * 4 * values
    # the planner counts exactly what the model holds (matrices at 2 bytes, the rest at 4)
    ckpt = resolve_checkpoint(str(bf16_ckpt[0]))
    assert planned_weight_layout(ckpt, frozenset(), "bf16", 4).total == held


def test_matches_transformers_on_the_bf16_values(bf16_ckpt, auto_llm):
    _, ref, _ = bf16_ckpt
    assert greedy_tokens(auto_llm, ref.prompts, 16) == ref.tokens
    assert max_logit_error(auto_llm, ref) <= 1e-4


def test_the_default_kv_cache_is_bf16(bf16_ckpt):
    """kv_cache_dtype "auto" under bf16 matrices keeps K/V in bf16, as vLLM's "auto" and
    transformers in bf16 do: the logits within that rounding (2^-9 relative a value) of
    transformers' float32 on the bf16 weights, and the captured step still equals the loop."""
    llm = LLM(model=str(bf16_ckpt[0]), quantization="bf16", **OPTS)
    assert model_runner(llm).kv_cache.dtype == torch.bfloat16
    assert max_logit_error(llm, bf16_ckpt[1]) <= BF16_KV_ERROR
    check_captured_equals_loop(llm, bf16_ckpt[2])


def test_captured_step_equals_the_layer_loop(bf16_ckpt, auto_llm):
    check_captured_equals_loop(auto_llm, bf16_ckpt[2])


def test_same_tokens_as_todays_float32_path(bf16_ckpt, auto_llm):
    """quantization="none" with dtype="float32" forces the other way (float32 upcast, PyTorch
    matmuls; dtype="auto" would be torch's bf16 on a CPU with native bf16)."""
    upcast = LLM(model=str(bf16_ckpt[0]), quantization="none", dtype="float32", **OPTS)
    assert upcast.llm_engine.config.quantization == "none"
    assert greedy_tokens(upcast, bf16_ckpt[2], 16) == greedy_tokens(auto_llm, bf16_ckpt[2], 16)


def test_each_fma_variant_gives_the_same_bits(bf16_ckpt, auto_llm):
    """The float32-x variants this CPU runs (avx512f, avx2, scalar) are one summation order:
    forced in turn, the engine's logits are bit for bit the same."""
    ids = bf16_ckpt[2][1]
    chosen = bf16_kernel().name
    fma = [v for v in bf16_kernel().runnable if v not in BF16_X]
    try:
        logits = {}
        for v in fma:
            torch.ops.pagedllm.set_bf16_kernel(v)
            logits[v] = last_logits(auto_llm, ids)
    finally:
        torch.ops.pagedllm.set_bf16_kernel(chosen)
    assert "scalar" in logits and len(logits) >= 2
    assert all(torch.equal(t, logits["scalar"]) for t in logits.values())


@pytest.mark.parametrize("variant", BF16_X)
def test_the_bf16_x_variants(bf16_ckpt, auto_llm, variant):
    """amx and avx512bf16, where the CPU runs them: the logits within the rounding of x to bf16
    (2^-9 relative a value, through both layers) of transformers' on the bf16 values."""
    if variant not in bf16_kernel().runnable:
        pytest.skip(f"this CPU does not run the {variant} bf16 kernels")
    chosen = bf16_kernel().name
    try:
        torch.ops.pagedllm.set_bf16_kernel(variant)
        error = max_logit_error(auto_llm, bf16_ckpt[1])
    finally:
        torch.ops.pagedllm.set_bf16_kernel(chosen)
    assert error <= 0.15


def test_an_explicit_dtype_keeps_vllms_behaviour(bf16_ckpt):
    fp32 = LLM(model=str(bf16_ckpt[0]), dtype="float32", **OPTS)
    assert (fp32.llm_engine.config.quantization, fp32.llm_engine.config.dtype) == (
        "none", torch.float32)
    bf16 = LLM(model=str(bf16_ckpt[0]), dtype="bfloat16", **OPTS)
    assert (bf16.llm_engine.config.quantization, bf16.llm_engine.config.dtype) == (
        "none", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype='bfloat16' with quantization='bf16'"):
        LLM(model=str(bf16_ckpt[0]), dtype="bfloat16", quantization="bf16", **OPTS)


def test_a_float32_checkpoint_stays_float32(tmp_path):
    """dtype="auto" on a float32 checkpoint never rounds it to bf16; quantization="bf16"
    does, when asked for."""
    model = _tiny("qwen2").eval()
    random_init(model, seed=4, scale=0.2)
    hf_dir = save_hf_dir(model, tmp_path / "hf")
    llm = LLM(model=str(hf_dir), **OPTS)
    assert (llm.llm_engine.config.quantization, llm.llm_engine.config.dtype) == (
        "none", torch.float32)
    asked = LLM(model=str(hf_dir), quantization="bf16", **OPTS)
    assert asked.llm_engine.config.quantization == "bf16"
    with torch.no_grad():  # the matrices are rounded; norms and biases stay float32
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).float())
    ref = hf_reference(model, prompts((9,), seed=5), num_tokens=4)
    assert max_logit_error(asked, ref) <= 1e-4
