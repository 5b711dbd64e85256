"""Device resolution with reasons, env variables, and the simulated CUDA-build-without-driver machine."""
import logging

import pytest
import torch

from pagedllm import platforms
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_builder import make_engine_config
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.platforms import gpu


@pytest.fixture
def cuda_build_without_driver(monkeypatch):
    """What a CUDA build of torch reports on a VM with no NVIDIA driver."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "nvidia_driver_present", lambda: False)
    for var in platforms.DEVICE_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def test_cuda_build_without_driver_resolves_to_cpu_with_reason(cuda_build_without_driver, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        choice = platforms.resolve_platform("auto")
    assert choice.platform.name == "cpu"
    cuda = next(p for p in choice.probes if p.platform == "cuda")
    assert not cuda.usable and "built for CUDA 13.0; no NVIDIA driver found" in cuda.detail
    assert "device cpu" in caplog.text and "no NVIDIA driver found" in caplog.text


def test_cpu_works_with_a_cuda_build_from_argument_and_env(cuda_build_without_driver, monkeypatch):
    assert platforms.resolve_platform("cpu").platform.name == "cpu"
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    choice = platforms.resolve_platform("auto")
    assert choice.platform.name == "cpu" and choice.source == "VLLM_TARGET_DEVICE"
    monkeypatch.setenv("PAGEDLLM_DEVICE", "cpu")
    assert platforms.resolve_platform(None).source == "PAGEDLLM_DEVICE"


def test_cuda_asked_on_a_machine_without_gpu_says_what_was_found(cuda_build_without_driver,
                                                                 monkeypatch):
    with pytest.raises(ValueError, match="device='cuda'.*no NVIDIA driver found.*Usable here: cpu"):
        platforms.resolve_platform("cuda")
    monkeypatch.setenv("PAGEDLLM_DEVICE", "cuda")
    with pytest.raises(ValueError, match=r"\(PAGEDLLM_DEVICE\)"):
        platforms.resolve_platform("auto")


def test_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        platforms.resolve_platform("tpu")


def test_dtypes():
    cpu = platforms.cpu_platform()
    assert platforms.resolve_dtype("float32", None, cpu) is torch.float32
    assert platforms.resolve_dtype(torch.bfloat16, None, cpu) is torch.bfloat16
    auto = platforms.resolve_dtype("auto", "bfloat16", cpu)
    assert auto is (torch.bfloat16 if platforms.cpu_has_native_bf16() else torch.float32)
    assert platforms.resolve_dtype("auto", "float32", cpu) is torch.float32
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        platforms.resolve_dtype("int3", None, cpu)


def test_engine_args_validation_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        EngineArgs(model="x", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len must be a positive int or None"):
        EngineArgs(model="x", max_model_len=-5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        EngineArgs.from_kwargs("x", bogus=1)
    with pytest.raises(ValueError, match="usage_context must be one of llm, api_server, got 'cli'"):
        EngineArgs(model="x", usage_context="cli")


def test_default_token_budget_depends_on_who_drives_the_engine(smollm_gguf):
    ckpt = resolve_checkpoint(str(smollm_gguf))
    offline = make_engine_config(EngineArgs(model=str(smollm_gguf)), ckpt)
    server = make_engine_config(EngineArgs(model=str(smollm_gguf), usage_context="api_server"), ckpt)
    given = make_engine_config(EngineArgs(model=str(smollm_gguf), usage_context="api_server",
                                          max_num_batched_tokens=1000), ckpt)
    assert offline.scheduler.max_num_batched_tokens == 2048  # SmolLM2's [2048, 1536] is 12 MiB
    assert server.scheduler.max_num_batched_tokens == 256
    assert given.scheduler.max_num_batched_tokens == 1000


def test_every_platform_is_an_engine_platform():
    """EngineConfig.platform's declared interface (config.EnginePlatform) is what each
    platform class offers, so the config's type says what the engine may ask of it."""
    from pagedllm.config import EnginePlatform
    from pagedllm.platforms.cpu import CpuPlatform
    from pagedllm.platforms.interface import Platform

    assert isinstance(platforms.cpu_platform(), EnginePlatform)
    names = {n for n in vars(EnginePlatform) if not n.startswith("_")}
    names |= set(EnginePlatform.__annotations__)
    assert {"device", "op_impl", "kernels_ready", "name"} <= names
    for cls in (Platform, CpuPlatform, gpu.TorchGpuPlatform):
        missing = sorted(m for m in names if not hasattr(cls, m))
        assert not missing, (cls.__name__, missing)
