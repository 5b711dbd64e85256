"""`pagedllm doctor`'s warning about a CUDA build of torch on a machine without an NVIDIA driver."""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import torch

from pagedllm.entrypoints.doctor import format_text, platform_report
from pagedllm.entrypoints.torch_build import (CPU_INDEX_URL, TorchBuildFacts, cuda_build_warning,
                                              cuda_library_bytes, torch_build_facts)
from pagedllm.platforms.interface import GiB

CUDA_NO_DRIVER = TorchBuildFacts("2.13.0+cu128", "12.8", False, int(3.5 * GiB),
                                 ("nvidia-cublas-cu12", "nvidia-cudnn-cu12"))


def test_cuda_build_without_driver_warns_with_size_and_command():
    warning = cuda_build_warning(CUDA_NO_DRIVER)
    assert warning.startswith("torch 2.13.0+cu128 is a CUDA 12.8 build but this machine has no "
                              "NVIDIA driver: its CUDA libraries take 3.50 GiB for nothing.")
    pip = f"{sys.executable} -m pip"
    assert warning.endswith(f"{pip} uninstall -y torch nvidia-cublas-cu12 nvidia-cudnn-cu12 && "
                            f"{pip} install torch==2.13.0 --index-url {CPU_INDEX_URL}")


def test_no_warning_with_a_driver_or_a_cpu_build():
    with_driver = TorchBuildFacts("2.13.0+cu128", "12.8", True, 0, ())
    cpu_build = TorchBuildFacts("2.13.0+cpu", None, False, 0, ())
    assert cuda_build_warning(with_driver) is None
    assert cuda_build_warning(cpu_build) is None


def _dist_info(site: Path, name: str, files: dict[str, int]) -> metadata.Distribution:
    """An installed distribution in site/ whose RECORD lists files of the given sizes."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for rel, size in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"\0" * size)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))
    return metadata.PathDistribution(info)


def test_cuda_bytes_count_nvidia_distributions_and_torch_cuda_libs(tmp_path):
    site = tmp_path / "site-packages"
    dists = [_dist_info(site, "nvidia-cublas-cu12", {"nvidia/cublas/lib/libcublas.so.12": 3000}),
             _dist_info(site, "nvidia-nccl-cu12", {"nvidia/nccl/lib/libnccl.so.2": 500}),
             _dist_info(site, "numpy", {"numpy/core/big.so": 100_000})]
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    (lib / "libtorch_cuda.so").write_bytes(b"\0" * 700)
    (lib / "libc10_cuda.so").write_bytes(b"\0" * 11)
    (lib / "libtorch_cpu.so").write_bytes(b"\0" * 90_000)
    total, names = cuda_library_bytes(lib, dists)
    assert total == 3000 + 500 + 700 + 11
    assert names == ("nvidia-cublas-cu12", "nvidia-nccl-cu12")


def test_this_machines_torch_build_and_report():
    facts = torch_build_facts()
    assert facts.torch_version == torch.__version__ and facts.cuda_version == torch.version.cuda
    report = platform_report("cpu")
    assert report["torch"]["cuda_build_warning"] == cuda_build_warning(facts)
    report["torch"]["cuda_build_warning"] = cuda_build_warning(CUDA_NO_DRIVER)
    lines = format_text(report).splitlines()
    assert lines[2] == "  warning: " + cuda_build_warning(CUDA_NO_DRIVER)
    assert lines[3] == "device probes:"
