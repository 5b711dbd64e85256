"""A real pagedllm server (subprocess, loopback): SmolLM2 for the session, the default model for
the modules that use qwen_server, other models per module."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

API_KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"
QWEN = "qwen"  # qwen_server's served name
QWEN_KEY = "qwen-key"
QWEN7B_SHAPES = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `pagedllm serve` process."""

    def __init__(self, *extra: str, model: str = MODEL,
                 preexec_fn: Optional[Callable[[], None]] = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the log goes to a file: a pipe nobody reads would block the server once full
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port",
             str(self.port), *(("--dtype", "float32") if model == MODEL else ()), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not become healthy in 180 s")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output."""
        with open(self.log.name) as fh:
            return fh.read()[-chars:]

    def metrics(self) -> dict[str, float]:
        """The /metrics page as name -> value, labelled series summed."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            m = re.match(r"^([a-z_:]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def wait_idle(self, seconds: float = 5.0) -> dict[str, float]:
        """Poll /metrics until nothing runs and no KV block is used, or `seconds` pass; the
        last reading."""
        deadline = time.monotonic() + seconds
        while True:
            m = self.metrics()
            idle = m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self) -> None:
        if self.log.closed:  # stopped already
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def server(smollm_gguf):
    # float32 path: test_sixteen_concurrent_streams_equal_sequential compares tokens across
    # batch shapes; float32 keeps that independent of the block kernels (which are
    # batch-invariant too, checked in tests/e2e/test_quantized.py with the quantized default)
    srv = Server("--api-key", API_KEY, "--max-num-seqs", "32", "--quantization", "none")
    yield srv
    srv.stop()


_LAST_QWEN_USER: dict[str, object] = {}


@pytest.fixture(scope="session")
def qwen_server(qwen_gguf, request):
    """The default model (Qwen2.5-Coder-0.5B-Instruct GGUF) served as QWEN with the hermes tool
    parser, 2048 tokens, a key, and a response store of 8: one start for the chat tool-call,
    Messages and Responses modules. Stopped after the last test that uses it, not at the
    session's end, so its memory is not kept under the modules that follow."""
    users = [item for item in request.session.items if "qwen_server" in item.fixturenames]
    srv = Server("--served-model-name", QWEN, "--enable-auto-tool-choice", "--tool-call-parser",
                 "hermes", "--max-model-len", "2048", "--api-key", QWEN_KEY,
                 "--responses-store-max-entries", "8", model=str(qwen_gguf))
    if users:
        _LAST_QWEN_USER[users[-1].nodeid] = srv
    yield srv
    srv.stop()


def pytest_runtest_teardown(item, nextitem):
    srv = _LAST_QWEN_USER.pop(item.nodeid, None)
    if srv is not None:
        srv.stop()


@pytest.fixture(scope="session")
def thinking_dir(qwen_hf_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny thinking Qwen3 of thinking_model.py (Qwen3's template, a known output)."""
    from thinking_model import build_thinking_qwen3

    return build_thinking_qwen3(qwen_hf_dir, tmp_path_factory.mktemp("thinking-qwen3"))


@pytest.fixture(scope="session")
def huge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-shaped checkpoint (config and index, no weights) of 2**50 bytes: no machine
    holds it, and planning reads only its metadata."""
    path = tmp_path_factory.mktemp("huge")
    shutil.copy(QWEN7B_SHAPES / "config.json", path / "config.json")
    index = json.loads((QWEN7B_SHAPES / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = 2 ** 50
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path
