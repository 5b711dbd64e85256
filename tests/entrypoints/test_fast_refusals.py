"""Refusals of the command line come before the engine, torch or transformers is imported."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, status, message", [
    (("serve", "--bogus-flag"), 2, "unrecognized arguments: --bogus-flag"),
    (("serve", "--port", "0", "--max-num-seqs", "0"), 1,
     "max_num_seqs must be a positive int, got 0"),
    (("serve", "--port", "0", "/nonexistent/model.gguf"), 1, "is neither an existing local path"),
])
def test_refusal_is_one_line(argv, status, message):
    done = _cli(*argv)
    assert done.returncode == status and message in done.stderr
    assert "Traceback" not in done.stderr


def test_parsing_and_checking_values_import_no_torch():
    """In a fresh interpreter: the parser and the serve flags' EngineArgs are built (where a
    bad value is refused) without torch, transformers or the engine."""
    code = ("import sys\nfrom pagedllm.entrypoints.cli import build_parser\n"
            "from pagedllm.entrypoints.serve import engine_args\n"
            "args = build_parser().parse_args(['serve', '--max-num-seqs', '4', 'x.gguf'])\n"
            "engine_args(args)\n"
            "heavy = [m for m in ('torch', 'transformers', 'pagedllm.engine.async_engine') "
            "if m in sys.modules]\nprint(heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "0", "/nonexistent/model.gguf"], ["run", "no-such-model"],
    ["bench", "latency", "--model", "/no/such.gguf"], ["doctor", "/no/such.gguf"]])
def test_unknown_model_is_refused_before_torch(argv):
    """A model reference that names nothing (no path, no shipped name, no Hub id) is refused
    by the command line itself, in an interpreter that never imported torch or the engine."""
    code = ("import sys\nfrom pagedllm.entrypoints.cli import main\n"
            f"status = main({argv!r})\n"
            "heavy = [m for m in ('torch', 'transformers', 'pagedllm.engine.llm_engine') "
            "if m in sys.modules]\nprint(status, heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "1 []", done.stderr
    assert "is neither an existing local path" in done.stderr and "Traceback" not in done.stderr
