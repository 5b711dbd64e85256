"""The dtype and code-path choices on the kinds of CPU the project meets: AVX2 only (float32
fastest), AVX-512 with native bf16, and that with AMX. Whichever this machine is, every choice
runs here, by handing the engine a CPU platform with the other feature sets."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.engine import config_builder
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader.checkpoint import generation_config, resolve_checkpoint
from pagedllm.tokenizer.tokenizer import load_tokenizer
from pagedllm.platforms import PlatformChoice
from pagedllm.platforms.cpu import CpuInfo, CpuPlatform
from pagedllm.platforms.interface import MemoryInfo
from pagedllm.sampling_params import SamplingParams

CPUS = {
    "avx2": ("avx2",),  # AMD Zen 3
    "avx512_bf16": ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"),  # Zen 4/5, Cooper Lake
    "amx": ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"),
}


@pytest.fixture(params=sorted(CPUS))
def cpu(request, monkeypatch) -> CpuPlatform:
    """The engine's platform, as if the CPU had this feature set."""
    platform = CpuPlatform(CpuInfo("test cpu", CPUS[request.param], 2, "test"))
    choice = PlatformChoice(platform, (), "cpu", "test")
    monkeypatch.setattr(config_builder, "resolve_platform", lambda device: choice)
    return platform


def _config(model, checkpoint_dtype=None, **kwargs):
    args = EngineArgs(model=str(model), max_model_len=512, **kwargs)
    ckpt = resolve_checkpoint(model)
    if checkpoint_dtype:  # as a bf16 checkpoint says in its config.json
        ckpt = dataclasses.replace(ckpt, arch=dataclasses.replace(ckpt.arch,
                                                                  torch_dtype=checkpoint_dtype))
    return config_builder.make_engine_config(args, ckpt)


def test_kept_blocks_compute_in_float32_on_every_cpu(cpu, smollm_gguf):
    config = _config(smollm_gguf)
    assert config.quantization == "gguf" and config.dtype == torch.float32
    assert config.platform is cpu
    assert cpu.attention_backend(config.dtype) == "cpu" and cpu.op_impl(config.dtype) == "cpu"
    with pytest.raises(ValueError, match="dtype='bfloat16' with quantization='gguf'"):
        _config(smollm_gguf, dtype="bfloat16")


def test_dense_auto_dtype_follows_the_cpu(cpu, smollm_hf_dir):
    """A bf16 checkpoint with dtype="auto" keeps its matrices in bf16 for pagedllm's kernels
    (float32 activations, the C++ ops) on every CPU; quantization="none" is the float path:
    native bf16 where the CPU has it, else float32; an explicit dtype is vLLM's."""
    config = _config(smollm_hf_dir, checkpoint_dtype="bfloat16")
    assert config.quantization == "bf16" and config.dtype == torch.float32
    assert cpu.attention_backend(config.dtype) == "cpu" and cpu.op_impl(config.dtype) == "cpu"
    config = _config(smollm_hf_dir, checkpoint_dtype="bfloat16", quantization="none")
    want = torch.bfloat16 if cpu.info.native_bf16 else torch.float32
    assert config.quantization == "none" and config.dtype == want
    # bf16 runs the PyTorch ops and attention; float32 the C++ ones
    assert cpu.attention_backend(want) == ("torch" if want == torch.bfloat16 else "cpu")
    assert cpu.op_impl(want) == ("native" if want == torch.bfloat16 else "cpu")
    for dtype in ("bfloat16", "float32"):
        config = _config(smollm_hf_dir, checkpoint_dtype="bfloat16", dtype=dtype)
        assert config.quantization == "none" and config.dtype == getattr(torch, dtype)
    config = _config(smollm_hf_dir, checkpoint_dtype="float16")
    assert config.quantization == "none"  # bf16 would round float16 values


def test_kv_cache_dtype_auto_the_compute_dtype_or_bf16_under_float32(cpu, smollm_gguf,
                                                                    smollm_hf_dir):
    """The KV cache is kept in the dtype the model computes in ("auto", or that dtype's name),
    or in bf16 under float32 compute on the CPU (half the bytes a token in the memory plan);
    another (fp8, float16) is refused naming the field, the dtype and what to use; an unknown
    name is refused listing the choices."""
    for asked in ("auto", "float32"):
        config = _config(smollm_gguf, kv_cache_dtype=asked)
        assert config.dtype == torch.float32 and config.cache.dtype is None
    bf16 = _config(smollm_gguf, kv_cache_dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    f32 = _config(smollm_gguf, kv_cache_memory_bytes=64 << 20)
    assert bf16.dtype == torch.float32 and bf16.cache.dtype == torch.bfloat16
    assert bf16.cache.num_blocks == 2 * f32.cache.num_blocks  # the same bytes, twice the tokens
    for asked in ("fp8", "fp8_e5m2", "float16"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{asked}': pagedllm keeps the KV "
                                             r"cache in the dtype the model computes in, float32 "
                                             r"here.*use kv_cache_dtype='auto' \(or 'float32'\) "
                                             r"or 'bfloat16'"):
            _config(smollm_gguf, kv_cache_dtype=asked)
    config = _config(smollm_hf_dir, checkpoint_dtype="bfloat16", dtype="bfloat16",
                     kv_cache_dtype="bfloat16")
    assert config.dtype == torch.bfloat16 and config.cache.dtype is None
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float32': .* bfloat16 here; use "
                                         r"kv_cache_dtype='auto' \(or 'bfloat16'\), or"):
        _config(smollm_hf_dir, checkpoint_dtype="bfloat16", dtype="bfloat16",
                kv_cache_dtype="float32")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not a KV cache dtype; the "
                                         r"choices are auto, bfloat16, float16, float32, fp8"):
        EngineArgs(model=str(smollm_gguf), kv_cache_dtype="int8")


def test_kv_cache_auto_is_bf16_under_bf16_weights(cpu, smollm_hf_dir):
    """A bf16 checkpoint's matrices kept in bf16 (quantization "bf16", float32 compute): "auto"
    keeps the KV cache in bf16, as vLLM's "auto" (the model's dtype), twice the tokens in the
    same bytes; "float32" keeps the float32 cache. Blocks quantized at load (int8) and
    dequantized weights keep the cache in the compute dtype."""
    sized = dict(checkpoint_dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    auto = _config(smollm_hf_dir, **sized)
    assert auto.quantization == "bf16" and auto.dtype == torch.float32
    assert auto.cache.dtype == torch.bfloat16
    f32 = _config(smollm_hf_dir, kv_cache_dtype="float32", **sized)
    assert f32.quantization == "bf16" and f32.cache.dtype is None
    assert auto.cache.num_blocks == 2 * f32.cache.num_blocks
    assert _config(smollm_hf_dir, kv_cache_dtype="bfloat16", **sized).cache.dtype == torch.bfloat16
    for quantization in ("int8", "none"):
        config = _config(smollm_hf_dir, quantization=quantization, **sized)
        assert config.cache.dtype is None, quantization


def test_the_captured_decode_runs_on_both_cpus_with_the_same_tokens(smollm_gguf, monkeypatch):
    ckpt = resolve_checkpoint(smollm_gguf)
    tokenizer, gen = load_tokenizer(ckpt.tokenizer_path), generation_config(ckpt)
    results = {}
    for name, features in CPUS.items():
        choice = PlatformChoice(CpuPlatform(CpuInfo("test cpu", features, 2, "test")), (),
                                "cpu", "test")
        monkeypatch.setattr(config_builder, "resolve_platform", lambda device: choice)
        engine = LLMEngine(_config(smollm_gguf), tokenizer, gen)
        assert engine.engine_core.executor.model_runner.captured_decode is not None, name
        engine.add_request("r", "def add(a, b):", SamplingParams(temperature=0, max_tokens=12))
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[name] = list(out.outputs[0].token_ids)
    assert len(results["avx2"]) == 12 and results["avx2"] == results["avx512_bf16"]


def test_an_hf_checkpoint_logs_its_weight_formats_cost(cpu, smollm_hf_dir, caplog):
    caplog.set_level("INFO", logger="pagedllm")
    _config(smollm_hf_dir, checkpoint_dtype="bfloat16")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight format")]
    assert len(lines) == 1 and lines[0].startswith('weight format bf16x8 (quantization="bf16")')
    assert 'instead int8 (quantization="int8"): weights' in lines[0]
    caplog.clear()
    _config(smollm_hf_dir, checkpoint_dtype="bfloat16", quantization="none")
    chosen = "bf16" if cpu.info.native_bf16 else "fp32"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight format")]
    assert len(lines) == 1 and lines[0].startswith(f"weight format {chosen} (")
    caplog.clear()
    _config(smollm_hf_dir, quantization="int8")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight format")]
    assert lines[0].startswith('weight format int8 (quantization="int8")')
    assert 'instead bf16x8 (quantization="bf16")' in lines[0]


def test_int8_at_load_is_planned_as_its_blocks(cpu, smollm_hf_dir, monkeypatch):
    """quantization="int8" on a float checkpoint plans the Q8_0 blocks it runs with (twice at
    the load's peak, regrouped), not the float32 weights it is read from: 900 MiB refuses
    SmolLM2 in float32 (538 MB of weights) and holds it in int8 (~180 MB of blocks)."""
    mem = MemoryInfo(900 * 1024 ** 2, 900 * 1024 ** 2, "test: 900 MiB")
    monkeypatch.setattr(cpu, "memory", lambda: mem)
    with pytest.raises(ValueError, match="does not fit"):
        _config(smollm_hf_dir, dtype="float32")
    config = _config(smollm_hf_dir, dtype="float32", quantization="int8")
    assert config.quantization == "int8" and config.cache.num_blocks > 0


def test_lora_slots_are_planned_beside_the_weights(smollm_gguf, caplog):
    """The adapters' slots and read copies count in the plan's weights: max_loras=2 and
    max_cpu_loras=4 of rank 64 on SmolLM2 (30 layers, 576 wide, 1536 in its MLP) are
    6 x 64 x 30 x (2 x (576 + 576) + 2 x (576 + 192) + 3 x (576 + 1536)) x 4 bytes."""
    from pagedllm.memory.footprint import lora_bytes

    ckpt = resolve_checkpoint(smollm_gguf)
    args = EngineArgs(model=str(smollm_gguf), max_model_len=512)
    with_lora = dataclasses.replace(args, enable_lora=True, max_loras=2, max_lora_rank=64,
                                    max_cpu_loras=4)
    base, _ = config_builder.plan_engine_memory(args, ckpt, config_builder.resolve_platform(
        "cpu").platform, torch.float32)
    with caplog.at_level("INFO", logger="pagedllm"):
        planned = config_builder.make_engine_config(with_lora, ckpt)
    expected = 6 * 64 * 30 * (2 * 1152 + 2 * 768 + 3 * 2112) * 4
    assert lora_bytes(ckpt.arch, planned.lora) == expected
    lora_plan, _ = config_builder.plan_engine_memory(with_lora, ckpt, planned.platform,
                                                     torch.float32)
    assert lora_plan.weight_bytes - base.weight_bytes == expected
    assert "LoRA adapters: 2 slots and 4 read adapters of rank 64 at most" in caplog.text
