"""The cache root: the environment variable, else the default under the home directory."""
import pathlib

from pagedllm.paths import cache_dir


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "~/elsewhere")
    assert cache_dir() == pathlib.Path.home() / "elsewhere"
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR")
    assert cache_dir() == pathlib.Path.home() / ".cache" / "pagedllm"
