"""Compiled CPU kernels: built once per machine with the local compiler, cached, loaded as torch ops.

The build is keyed by the source, the compiler flags, the torch version and the CPU's instruction-set flags, because
it is compiled for the CPU it runs on (-march=native). `python -m pagedllm.kernels` builds it ahead
of time (scripts/setup.sh does); otherwise the first quantized model load builds it (~1 minute).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import torch

from pagedllm.paths import cache_dir

logger = logging.getLogger("pagedllm")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))  # every translation unit; headers are included
_LOCK = threading.Lock()
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded; the message says why and what to do."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    """Short hash of what the compiled library depends on."""
    h = hashlib.sha256()
    for source in sorted(p for p in _CSRC.iterdir() if p.is_file()):
        h.update(source.name.encode() + source.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{_cpu_flags()}|{_CFLAGS}".encode())
    return h.hexdigest()[:16]


def _build_dir(key: str) -> Path:
    return cache_dir() / "kernels" / key


def _ensure_ninja_on_path() -> None:
    # the `ninja` wheel puts its binary next to the interpreter, which may not be on PATH
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


@lru_cache(maxsize=1)
def _load() -> None:
    key = build_key()
    build_dir = _build_dir(key)
    built = build_dir / f"pagedllm_ggml_{key}.so"
    if built.is_file():  # the key covers the sources, torch and the CPU: load it as it is
        torch.ops.load_library(str(built))
        return
    from torch.utils import cpp_extension  # imports setuptools (~0.3 s): only to build

    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    started = time.monotonic()
    logger.info("compiling pagedllm CPU kernels into %s (once per machine, about a minute)",
                build_dir)
    try:
        cpp_extension.load(name=f"pagedllm_ggml_{key}", sources=[str(s) for s in _SOURCES],
                           extra_cflags=list(_CFLAGS), extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False,
                           verbose=False)
    except Exception as err:  # compiler missing, headers missing, link error
        raise KernelBuildError(
            f"could not build pagedllm's CPU kernels in {build_dir}: {err}\n"
            "  ways out: install a C++ compiler (apt install g++) and ninja (pip install ninja), "
            "or load the model dequantized with quantization='none'") from err
    logger.info("compiled pagedllm CPU kernels in %.0f s", time.monotonic() - started)


def kernels_loaded() -> bool:
    """True once the kernels are loaded in this process (never builds)."""
    return _load.cache_info().currsize > 0


def load_kernels() -> None:
    """Build (if needed) and load the kernels; torch.ops.pagedllm.* exist afterwards."""
    with _LOCK:
        _load()


def kernels_available() -> bool:
    """True when the kernels load (building them if needed); failures are logged, not raised."""
    try:
        load_kernels()
        return True
    except KernelBuildError as err:
        logger.warning("%s", err)
        return False
