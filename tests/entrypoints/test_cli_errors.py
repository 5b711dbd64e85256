"""Every refusal of the command line is one message (plus its ways out) and a non-zero exit, with
no traceback unless --debug; LLM() raises the same message as one exception, not a chain."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub"))  # the fake Hub's module
from fake_hub import FakeHub, FakeRepo, closed_port  # noqa: E402

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment with an empty Hugging Face cache under tmp_path and no token."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "PAGEDLLM_USE_MODELSCOPE", "VLLM_USE_MODELSCOPE",
                        "PAGEDLLM_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL")}
    env.update({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
                "HF_HUB_OFFLINE": "0", **extra})
    return env


def _refused(args: list[str], env: Optional[dict[str, str]] = None, code: int = 1,
             timeout: float = 180) -> str:
    """Run the CLI, expect exit status `code` and a traceback-free stderr; the error line."""
    proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("command", [
    ["serve", "{model}"], ["chat", "--model", "{model}"], ["complete", "--model", "{model}", "hi"],
    ["bench", "latency", "--model", "{model}"], ["doctor", "{model}"], ["run", "{model}"],
    ["pull", "{model}"]])
def test_a_model_that_does_not_exist_is_one_line_in_every_command(command, tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    line = _refused([part.format(model=missing) for part in command], _env(tmp_path))
    assert line.startswith(f"pagedllm {command[0]}: error: ") and missing in line


def test_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    for args, extra in ((["--debug", "complete", "--model", missing, "hi"], {}),
                        (["complete", "--model", missing, "hi", "--debug"], {}),
                        (["complete", "--model", missing, "hi"],
                         {"PAGEDLLM_LOGGING_LEVEL": "DEBUG"})):
        proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=180,
                              env=_env(tmp_path, **extra))
        assert proc.returncode != 0
        assert "Traceback" in proc.stderr and missing in proc.stderr, args


def test_not_cached_offline(tmp_path):
    line = _refused(["serve", "test/not-cached", "--port", str(closed_port())], _env(tmp_path, HF_HUB_OFFLINE="1"))
    assert "'test/not-cached'" in line and "is not cached" in line and "HF_HUB_OFFLINE=1" in line


@pytest.fixture(scope="module")
def hub(smollm_gguf: Path):
    """A fake Hub holding one gated GGUF repo."""
    with FakeHub({"test/gated-GGUF": FakeRepo({GGUF_NAME: smollm_gguf}, gated=True)}) as server:
        yield server


def test_gated_and_missing_hub_repos(hub, tmp_path):
    env = _env(tmp_path, HF_ENDPOINT=hub.url)
    line = _refused(["serve", "test/gated-GGUF:Q4_1", "--port", str(closed_port())], env)
    assert "'test/gated-GGUF' is gated" in line and "HF_TOKEN" in line
    line = _refused(["complete", "--model", "test/no-such-repo", "hi"], env)
    assert f"'test/no-such-repo' was not found at {hub.url}" in line


def test_unreachable_hub_lists_the_ways_out(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    line = _refused(["serve", "test/some-model", "--port", str(closed_port())], _env(tmp_path, HF_ENDPOINT=endpoint))
    assert f"cannot reach the Hugging Face Hub at {endpoint}" in line
    assert "ways out:" in line and "HF_ENDPOINT=https://hf-mirror.com" in line


def test_a_model_that_does_not_fit_lists_the_ways_out(huge_model, tmp_path):
    proc = subprocess.run(CLI + ["serve", str(huge_model), "--port", str(closed_port())],
                          capture_output=True, text=True, timeout=180, env=_env(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.index("pagedllm serve: error: "):]
    assert message.startswith("pagedllm serve: error: the model does not fit in memory")
    assert "ways out:" in message and "4-bit GGUF" in message


@pytest.mark.parametrize("args, expected", [
    (["serve", "--no-such-flag"], "pagedllm serve: error: unrecognized arguments: --no-such-flag"),
    (["serve", "--mod", "x"], "unrecognized arguments: --mod "),  # no prefix of --model-source
    (["serve", "a", "--model", "b"], "the model is given twice"),
    (["serve", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
    (["serve", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["bench", "latency", "--num-prompts", "0"], "must be an integer of at least 1"),
])
def test_bad_flags_are_one_line(args, expected):
    proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr


def test_a_bad_value_is_refused_by_the_engine_in_one_line(tmp_path):
    line = _refused(["serve", "smollm2-135m-instruct", "--max-num-seqs", "0",
                     "--port", str(closed_port())], _env(tmp_path))
    assert "max_num_seqs must be a positive int, got 0" in line


def test_a_busy_port_is_refused_at_once_before_any_load(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(CLI + ["serve", "smollm2-135m-instruct", "--port", str(port)],
                              capture_output=True, text=True, timeout=60, env=_env(tmp_path))
        seconds = time.monotonic() - started
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == (f"pagedllm serve: error: port {port} on 127.0.0.1 is already in use "
                           "(another server?); pass --port with a free port or stop the other "
                           "process\n")  # and nothing else: no device probe, plan or load
    assert seconds < 5, seconds


def test_a_truncated_gguf(smollm_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm_gguf, "rb") as fh:
        truncated.write_bytes(fh.read(1 << 20))
    line = _refused(["complete", "--model", str(truncated), "hi"], _env(tmp_path))
    assert line.startswith(f"pagedllm complete: error: {truncated}: ")


def test_a_server_that_is_down(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    line = _refused(["chat", "--url", url], _env(tmp_path))
    assert f"cannot reach {url}" in line
    line = _refused(["bench", "serve", "--url", url, "--num-prompts", "1"], _env(tmp_path))
    assert f"cannot reach {url}" in line


def test_kernels_that_cannot_be_built(smollm_gguf, tmp_path):
    """No compiler, in an empty kernel cache: quantization='gguf' is refused in one line that
    says why the kernels did not build and what to do."""
    compiler = str(tmp_path / "no-such-c++")
    line = _refused(["serve", str(smollm_gguf), "--quantization", "gguf", "--port",
                     str(closed_port())],
                    _env(tmp_path, PAGEDLLM_CACHE_DIR=str(tmp_path / "cache"), CXX=compiler))
    assert line == ("pagedllm serve: error: quantization='gguf' needs pagedllm's CPU kernels, "
                    f"which could not be built: no C++ compiler: CXX={compiler} does not exist; "
                    "install g++ or set CXX")


def _single(err: BaseException) -> bool:
    """True for an exception raised on its own: no cause, and no context left showing."""
    return err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_llm_raises_the_same_message_as_one_exception(huge_model, tmp_path, monkeypatch):
    from pagedllm import LLM
    from pagedllm.hub.hub import HubError
    from pagedllm.memory.plan import InsufficientMemoryError

    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(ValueError) as info:
        LLM(missing)
    assert _single(info.value)
    assert f"pagedllm complete: error: {info.value}" == _refused(
        ["complete", "--model", missing, "hi"], _env(tmp_path))
    with pytest.raises(InsufficientMemoryError, match="does not fit in memory") as info:
        LLM(str(huge_model))
    assert _single(info.value)
    for var, value in _env(tmp_path, HF_HUB_OFFLINE="1").items():
        monkeypatch.setenv(var, value)
    with pytest.raises(HubError, match="is not cached") as info:
        LLM("test/not-cached")
    assert _single(info.value)
