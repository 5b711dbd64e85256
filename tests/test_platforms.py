"""Device and dtype resolution."""
import pytest
import torch

from pagedllm import platforms
from pagedllm.engine.arg_utils import EngineArgs


def test_auto_and_cpu_devices():
    assert platforms.resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert platforms.resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no usable CUDA GPU.*device='cpu'"):
        platforms.resolve_device("cuda")


def test_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda"):
        platforms.resolve_device("tpu")


def test_dtypes():
    cpu = torch.device("cpu")
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
