"""The sampler tests run on both implementations: PyTorch ops (Sampler()) and pagedllm's C++
ops (Sampler(cpu_ops=True): the CPU platform's choice, kernels/csrc/sampling.cpp)."""
from __future__ import annotations

import pytest

from pagedllm.kernels import kernels_available, load_kernels
from pagedllm.sample import Sampler

_CPU_OPS = [False]


@pytest.fixture(autouse=True, params=["torch", "cpu"])
def sampler_impl(request):
    if request.param == "cpu":
        if not kernels_available():
            pytest.skip("CPU kernels unavailable")
        load_kernels()
    _CPU_OPS[0] = request.param == "cpu"
    yield request.param
    _CPU_OPS[0] = False


def make_sampler() -> Sampler:
    return Sampler(cpu_ops=_CPU_OPS[0])
