"""Whether the installed torch build suits this machine: a CUDA build without an NVIDIA driver
carries gigabytes of CUDA libraries that nothing here can use (`pagedllm doctor` says so)."""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Optional

import torch

from pagedllm.platforms.gpu import nvidia_driver_present
from pagedllm.platforms.interface import fmt_bytes

CPU_INDEX_URL = "https://download.pytorch.org/whl/cpu"
# torch/lib files of a CUDA build that a CPU build does not have (libtorch_cuda, libc10_cuda, and
# the CUDA libraries some wheels bundle)
_CUDA_LIB_MARKERS = ("cuda", "cudnn", "cublas", "cufft", "curand", "cusolver", "cusparse", "nccl",
                     "nvrtc", "nvjitlink", "nvtoolsext", "cupti")


@dataclass(frozen=True)
class TorchBuildFacts:
    """What the CUDA-build check needs to know about this install and machine."""

    torch_version: str  # e.g. "2.13.0+cu128"
    cuda_version: Optional[str]  # torch.version.cuda: None for a CPU (or ROCm) build
    driver_present: bool  # an NVIDIA driver, nvidia-smi or a usable CUDA device
    cuda_bytes: int  # the nvidia-* distributions plus torch's own CUDA libraries
    cuda_packages: tuple[str, ...]  # names of the installed nvidia-* distributions


def cuda_build_warning(facts: TorchBuildFacts) -> Optional[str]:
    """A warning when torch is a CUDA build on a machine without an NVIDIA driver: the size it
    wastes and the command that swaps it for the CPU build; None otherwise."""
    if facts.cuda_version is None or facts.driver_present:
        return None
    release = facts.torch_version.split("+", 1)[0]
    pip = f"{sys.executable} -m pip"
    packages = " ".join(("torch",) + facts.cuda_packages)
    return (f"torch {facts.torch_version} is a CUDA {facts.cuda_version} build but this machine "
            f"has no NVIDIA driver: its CUDA libraries take {fmt_bytes(facts.cuda_bytes)} for "
            f"nothing. The CPU build: {pip} uninstall -y {packages} && "
            f"{pip} install torch=={release} --index-url {CPU_INDEX_URL}")


def cuda_library_bytes(torch_lib: Path, dists: Iterable[metadata.Distribution]
                       ) -> tuple[int, tuple[str, ...]]:
    """(bytes, names): the files of the nvidia-* distributions among dists, plus the CUDA
    libraries in torch's lib/ folder."""
    total, names = 0, []
    for dist in dists:
        name = dist.metadata["Name"] or ""
        if not name.lower().startswith("nvidia-"):
            continue
        names.append(name)
        for file in dist.files or ():
            path = Path(file.locate())
            total += path.stat().st_size if path.is_file() else 0
    if torch_lib.is_dir():
        total += sum(p.stat().st_size for p in torch_lib.iterdir() if p.is_file()
                     and any(m in p.name.lower() for m in _CUDA_LIB_MARKERS))
    return total, tuple(sorted(set(names)))


def torch_build_facts() -> TorchBuildFacts:
    """The facts of this process's torch and this machine (sizes only where they are wasted)."""
    cuda = torch.version.cuda
    if cuda is None:
        return TorchBuildFacts(torch.__version__, None, False, 0, ())
    if (nvidia_driver_present() or shutil.which("nvidia-smi") is not None
            or torch.cuda.is_available()):
        return TorchBuildFacts(torch.__version__, cuda, True, 0, ())
    size, names = cuda_library_bytes(Path(torch.__file__).parent / "lib",
                                     metadata.distributions())
    return TorchBuildFacts(torch.__version__, cuda, False, size, names)
