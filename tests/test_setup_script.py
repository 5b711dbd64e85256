"""scripts/setup.sh's choice of torch index, run by bash with pip replaced by a recorder.

The tests source a copy of the script in a temporary folder: were sourcing ever to run the whole
setup, it would build a venv there, not in the repository.
"""
from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Iterator

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "setup.sh"
UNREACHABLE = "http://127.0.0.1:9/whl/cpu"  # the discard port: nothing listens, refused at once

# pip_install records its arguments instead of installing; FAIL_INDEX makes an --index-url fail
DRIVER = """
source "$SETUP"
PY="$PYTHON"
pip_install() {
  echo "pip install $*"
  if [ -n "${FAIL_INDEX:-}" ] && [ "$1" = --index-url ]; then return 1; fi
}
install_cpu_torch
"""


@pytest.fixture
def setup_copy(tmp_path: Path) -> Path:
    """scripts/setup.sh copied to tmp_path/repo/scripts/."""
    copy = tmp_path / "repo" / "scripts" / "setup.sh"
    copy.parent.mkdir(parents=True)
    shutil.copy(SETUP, copy)
    return copy


def _install_cpu_torch(setup: Path, index_url: str,
                       fail_index: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, SETUP=str(setup), PYTHON=sys.executable,
               PAGEDLLM_TORCH_INDEX_URL=index_url, FAIL_INDEX="1" if fail_index else "")
    return subprocess.run(["bash", "-c", DRIVER], env=env, capture_output=True, text=True,
                          timeout=60, cwd=setup.parents[1])


def _pin() -> str:
    return re.search(r'^TORCH_CPU_PIN="(.+)"$', SETUP.read_text(), re.M).group(1)


@pytest.fixture
def index_url(tmp_path: Path) -> Iterator[str]:
    """A local package index with a torch/ page, served over HTTP for the probe."""
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    finally:
        server.shutdown()
        server.server_close()


def test_setup_script_parses():
    subprocess.run(["bash", "-n", str(SETUP)], check=True)


def test_torch_pin_satisfies_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    pinned = Requirement(_pin())
    assert pinned.name == "torch" and len(pinned.specifier) == 1
    version = next(iter(pinned.specifier)).version
    assert torch_req.specifier.contains(version), (str(torch_req), version)


def test_reachable_cpu_index_is_used(setup_copy, index_url):
    proc = _install_cpu_torch(setup_copy, index_url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"pip install --index-url {index_url} {_pin()}"]
    assert f"installing {_pin()} (CPU build) from {index_url}" in proc.stderr


def test_unreachable_index_falls_back_to_the_default_one_fast(setup_copy):
    started = time.monotonic()
    proc = _install_cpu_torch(setup_copy, UNREACHABLE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"pip install {_pin()}"]  # no --index-url
    assert f"{UNREACHABLE} did not answer" in proc.stderr
    assert "from pip's default index" in proc.stderr
    assert time.monotonic() - started < 30


def test_failed_install_from_the_cpu_index_falls_back(setup_copy, index_url):
    proc = _install_cpu_torch(setup_copy, index_url, fail_index=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"pip install --index-url {index_url} {_pin()}",
                                        f"pip install {_pin()}"]
    assert f"installing from {index_url} failed" in proc.stderr


def test_sourcing_runs_nothing(setup_copy):
    """Sourcing defines the functions only: no venv, no pip, no cd (even as `source "$0"`)."""
    elsewhere = setup_copy.parents[2] / "elsewhere"
    elsewhere.mkdir()
    # no python3 on PATH: a main that ran anyway would stop at once, with nothing installed
    proc = subprocess.run([shutil.which("bash"), "-c", 'source "$0" && pwd', str(setup_copy)],
                          capture_output=True, text=True, timeout=30, cwd=elsewhere,
                          env={"PATH": str(elsewhere)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(elsewhere) and proc.stderr == ""
    assert list(setup_copy.parents[1].iterdir()) == [setup_copy.parent]  # no .venv beside it


@pytest.mark.parametrize("want,have,covered", [
    ("", "", True), ("", "test,ray", True), ("test", "test,ray", True),
    ("test,ray", "ray,test", True), ("test,ray", "test", False), ("ray", "", False),
    ("te", "test", False)])
def test_extras_already_installed_are_not_installed_again(setup_copy, want, have, covered):
    """quickstart.sh asks for no extras and test.sh for test,ray: serving after testing must not
    reinstall, testing after serving must add the extras."""
    proc = subprocess.run(["bash", "-c", f'source "{setup_copy}"; extras_covered "{want}" "{have}"'],
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode == 0) == covered, proc.stderr


def test_quickstart_installs_no_test_extras():
    quickstart = (REPO / "scripts" / "quickstart.sh").read_text()
    assert "PAGEDLLM_SETUP_EXTRAS" not in quickstart  # serving: pagedllm's own dependencies only
    assert "PAGEDLLM_SETUP_EXTRAS=test,ray" in (REPO / "scripts" / "test.sh").read_text()
