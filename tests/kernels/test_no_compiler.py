"""Without a working compiler the kernels fail fast, and the fallback says so in one line.

Every build attempt runs in a subprocess with its own cache dir: a failed build is remembered
for the life of a process, and the other kernel tests need the real kernels in theirs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.kernels import _first_error_line, missing_build_tool

REPO = Path(__file__).resolve().parents[2]
# answers torch's version probes, fails every compile (as a compiler without the headers would)
FAKE_COMPILER = """#!/bin/sh
case "$1" in -v|--version|-dumpfullversion) echo "fakecc 1.0"; exit 0;; esac
echo "kernel.cpp:1:1: error: simulated compiler failure" >&2
exit 1
"""
PROGRESS = "compiling pagedllm CPU kernels into "  # python -m pagedllm.kernels logs at INFO


def _run(args: list[str], env_update: dict[str, str], cache: Path,
         timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PYTHONPATH=str(REPO), PAGEDLLM_CACHE_DIR=str(cache), **env_update)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    return proc, time.monotonic() - started


def _no_compiler_envs(tmp_path: Path) -> dict[str, dict[str, str]]:
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    return {"CXX=/nonexistent/c++": {"CXX": "/nonexistent/c++"},
            "PATH without c++": {"PATH": str(empty_bin)}}


def test_missing_build_tool_names_the_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++ -fno-foo")
    assert missing_build_tool() == ("no C++ compiler: CXX=/nonexistent/g++ does not exist; "
                                    "install g++ or set CXX")
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert missing_build_tool().startswith("no C++ compiler: 'no-such-compiler-xyz' is not on PATH")


def test_first_error_line_skips_ninja_noise():
    output = ("Error building extension 'x': [1/3] c++ -c a.cpp\nFAILED: a.o\n"
              "a.cpp:3:10: fatal error: foo.h: No such file or directory\n")
    assert _first_error_line(output) == "a.cpp:3:10: fatal error: foo.h: No such file or directory"
    assert _first_error_line("only line\n") == "only line"


@pytest.mark.parametrize("case", ["CXX=/nonexistent/c++", "PATH without c++"])
def test_build_without_compiler_fails_fast_in_one_line(tmp_path, case):
    proc, seconds = _run(["-m", "pagedllm.kernels"], _no_compiler_envs(tmp_path)[case],
                         tmp_path / "cache")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: pagedllm's CPU kernels could not be built: no C++ compiler")
    assert "build log" not in lines[0]  # nothing was run, so there is no log
    assert seconds < 30  # no ninja run, no compile: the time to import torch


def test_failed_compile_logs_to_a_file_named_in_one_line(tmp_path):
    fake = tmp_path / "bin" / "fakecc"  # not a name torch accepts: it logs a warning block
    fake.parent.mkdir()
    fake.write_text(FAKE_COMPILER)
    fake.chmod(0o755)
    proc, _ = _run(["-m", "pagedllm.kernels"], {"CXX": str(fake)}, tmp_path / "cache")
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(PROGRESS)]
    assert len(lines) == 1, proc.stderr
    assert "the build failed: kernel.cpp:1:1: error: simulated compiler failure" in lines[0]
    log = Path(lines[0].rsplit("build log: ", 1)[1])
    assert log.is_relative_to(tmp_path / "cache" / "kernels")
    text = log.read_text()
    assert "FAILED" in text and "simulated compiler failure" in text  # ninja's output
    assert "WARNING" in text and str(fake) in text  # torch's compiler warning, not on stderr


def test_llm_without_compiler_says_once_why_and_in_which_dtype(tmp_path, smollm_gguf):
    script = ("import sys\nfrom pagedllm import LLM, SamplingParams\n"
              "llm = LLM(model=sys.argv[1], max_model_len=64)\n"
              "out = llm.generate(['Hi'], SamplingParams(max_tokens=1), use_tqdm=False)\n"
              "print(str(llm.llm_engine.config.dtype).removeprefix('torch.'))\n"
              "print(len(out[0].outputs[0].token_ids))\n")
    # LLM() logs its choices at INFO; the warnings alone must be this one line
    proc, _ = _run(["-c", script, str(smollm_gguf)], {"CXX": "/nonexistent/c++",
                                                      "PAGEDLLM_LOGGING_LEVEL": "WARNING"},
                   tmp_path / "cache", timeout=300)
    assert proc.returncode == 0, proc.stderr
    dtype, tokens = proc.stdout.split()
    assert tokens == "1"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr  # not the build's output, not a second attempt
    line = lines[0]  # after the log line's level and time
    assert line.startswith("WARNING ")
    assert ("pagedllm's CPU kernels could not be built: no C++ compiler: "
            "CXX=/nonexistent/c++ does not exist") in line
    assert f"dequantized to {dtype} at load: weights " in line and "in GGUF blocks" in line
