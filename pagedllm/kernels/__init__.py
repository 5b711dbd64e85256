"""Compiled CPU kernels: built once per machine with the local compiler, cached, loaded as torch ops.

The build is keyed by the source, the compiler flags, the torch version and the CPU's instruction-set flags, because
it is compiled for the CPU it runs on (-march=native). The x8 matmuls are in it once per instruction set
(AVX2, AVX512-VNNI, AVX-VNNI), each compiled for its own target, and the one that runs is chosen
at run time from the CPU's features or PAGEDLLM_KERNEL_ISA (kernel_isa() says which and why); the
bf16 matmuls of a float checkpoint likewise, or PAGEDLLM_BF16_KERNEL (bf16_kernel()). `python -m pagedllm.kernels` builds it ahead
of time (scripts/setup.sh does); otherwise the first quantized model load builds it (~1 minute).
Without a compiler or ninja it fails at once; a failed build's output goes to build.log in the
build folder, and a process tries once (KernelBuildError says why, in one line).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional, TextIO

import torch

from pagedllm.paths import cache_dir

logger = logging.getLogger("pagedllm")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))  # every translation unit; headers are included
_LOCK = threading.Lock()
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded: why, in one line, and where the full
    build output went (None when the build never started, e.g. no compiler)."""

    def __init__(self, reason: str, log_path: Optional[Path] = None) -> None:
        super().__init__(reason + (f"; build log: {log_path}" if log_path else ""))
        self.reason = reason
        self.log_path = log_path


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
    # The CPU flags stay in the key although the x8 matmuls choose their variant at run time: the
    # rest of the library is -march=native, so a cache folder shared by machines of different
    # instruction sets holds one build per CPU instead of one that would SIGILL on the others.
    h = hashlib.sha256()
    for source in sorted(p for p in _CSRC.iterdir() if p.is_file()):
        h.update(source.name.encode() + source.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{_cpu_flags()}|{_CFLAGS}".encode())
    return h.hexdigest()[:16]


def _build_dir(key: str) -> Path:
    return cache_dir() / "kernels" / key


def _library_path(key: str) -> Path:
    return _build_dir(key) / f"pagedllm_ggml_{key}.so"


def kernels_built() -> bool:
    """True when this machine's build is in the cache (loading it would not compile)."""
    return _library_path(build_key()).is_file()


def _ensure_ninja_on_path() -> None:
    # the `ninja` wheel puts its binary next to the interpreter, which may not be on PATH
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def missing_build_tool() -> Optional[str]:
    """Why a build cannot start here (no C++ compiler, no ninja), or None; checked before
    torch's cpp_extension, which would log a warning block and run ninja to find out."""
    cxx = os.environ.get("CXX", "").strip() or "c++"  # what cpp_extension compiles with
    compiler = shlex.split(cxx)[0]
    if shutil.which(compiler) is None:
        where = f"CXX={compiler} does not exist" if os.sep in compiler else \
            f"{compiler!r} is not on PATH"
        return f"no C++ compiler: {where}; install g++ or set CXX"
    if shutil.which("ninja") is None:
        return "ninja is not installed; pip install ninja"
    return None


@contextmanager
def _torch_log_to(log: TextIO) -> Iterator[None]:
    """Send cpp_extension's log records (its compiler and ABI warning blocks) to the build log
    instead of stderr."""
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    handler = logging.StreamHandler(log)
    propagate = torch_logger.propagate
    torch_logger.addHandler(handler)
    torch_logger.propagate = False
    try:
        yield
    finally:
        torch_logger.removeHandler(handler)
        torch_logger.propagate = propagate


def _first_error_line(output: str) -> str:
    """The compiler's first error line of a failed build's output (else its first line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]  # gcc/clang: "file:line:col: error:"
    return (errors or lines or ["no output"])[0][:200]


def _build(key: str, build_dir: Path) -> None:
    """Compile and load the kernels into this process; KernelBuildError on any failure."""
    reason = missing_build_tool()
    if reason is not None:
        raise KernelBuildError(reason)
    from torch.utils import cpp_extension  # imports setuptools (~0.3 s): only to build

    log_path = build_dir / "build.log"
    started = time.monotonic()
    logger.info("compiling pagedllm CPU kernels into %s (once per machine, about a minute)",
                build_dir)
    with open(log_path, "w") as log, _torch_log_to(log):
        try:
            cpp_extension.load(name=f"pagedllm_ggml_{key}", sources=[str(s) for s in _SOURCES],
                               extra_cflags=list(_CFLAGS), extra_ldflags=["-fopenmp"],
                               build_directory=str(build_dir), is_python_module=False,
                               verbose=False)
        except Exception as err:  # headers missing, compile or link error, load error
            log.write(f"{type(err).__name__}: {err}\n")
            raise KernelBuildError(f"the build failed: {_first_error_line(str(err))}",
                                   log_path) from err
    logger.info("compiled pagedllm CPU kernels in %.0f s", time.monotonic() - started)


@lru_cache(maxsize=1)
def _load() -> Optional[KernelBuildError]:
    """Load the kernels, building them first if needed; the error when they cannot be, kept
    like a success so that a process tries once (a retry would only fail again, differently)."""
    key = build_key()
    build_dir = _build_dir(key)
    built = _library_path(key)
    if built.is_file():  # the key covers the sources, torch and the CPU: load it as it is
        torch.ops.load_library(str(built))
        return None
    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    try:
        _build(key, build_dir)
    except KernelBuildError as err:
        return err
    return None


def build_error() -> Optional[KernelBuildError]:
    """Why the kernels failed to build in this process; None if they loaded or were never tried."""
    return _load() if _load.cache_info().currsize > 0 else None


def kernels_loaded() -> bool:
    """True once the kernels are loaded in this process (never builds)."""
    return _load.cache_info().currsize > 0 and _load() is None


def load_kernels() -> None:
    """Build (if needed) and load the kernels; torch.ops.pagedllm.* exist afterwards. A
    PAGEDLLM_KERNEL_ISA this CPU cannot run is a ValueError here, before any model runs."""
    with _LOCK:
        error = _load()
    if error is not None:
        raise error
    _chosen_isa()
    _chosen_bf16()


def _chosen_isa() -> tuple[str, str]:
    """(variant, why) of the x8 matmuls, chosen on the first call; ValueError for a
    PAGEDLLM_KERNEL_ISA that names no variant or one this CPU cannot execute."""
    try:
        return torch.ops.pagedllm.kernel_isa()
    except RuntimeError as err:
        raise ValueError(str(err).splitlines()[0]) from None


def _chosen_bf16() -> tuple[str, str]:
    """(variant, why) of the bf16 x8 matmuls, chosen on the first call; ValueError for a
    PAGEDLLM_BF16_KERNEL that names no variant or one this CPU cannot execute."""
    try:
        return torch.ops.pagedllm.bf16_kernel()
    except RuntimeError as err:
        raise ValueError(str(err).splitlines()[0]) from None


def kernels_available() -> bool:
    """True when the kernels load (building them if needed); build_error() says why not."""
    try:
        load_kernels()
        return True
    except KernelBuildError:
        return False


@dataclass(frozen=True)
class KernelIsa:
    """The instruction-set variant the x8 matmuls run, why, and which ones this CPU can run."""

    name: str  # e.g. "avx512vnni", "avx2"
    reason: str  # e.g. "auto: the CPU has avx2 fma f16c ...", "PAGEDLLM_KERNEL_ISA=avx2"
    runnable: tuple[str, ...]  # best first


def kernel_isa() -> KernelIsa:
    """The x8 matmuls' variant (loads the kernels); ValueError when PAGEDLLM_KERNEL_ISA asks for
    one that does not exist or that this CPU cannot execute."""
    load_kernels()
    name, reason = _chosen_isa()
    return KernelIsa(name, reason, tuple(torch.ops.pagedllm.kernel_isas()))


def bf16_kernel() -> KernelIsa:
    """The variant a float checkpoint's bf16 matrices run (quantization="bf16", csrc/x8_bf16.cpp):
    vdpbf16ps (avx512bf16), AVX-512F or AVX2 FMAs on widened weights, or the scalar model;
    PAGEDLLM_BF16_KERNEL forces one (ValueError when this CPU cannot execute it)."""
    load_kernels()
    name, reason = _chosen_bf16()
    return KernelIsa(name, reason, tuple(torch.ops.pagedllm.bf16_kernels()))
