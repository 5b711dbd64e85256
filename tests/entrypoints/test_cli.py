"""The command line: `pagedllm chat` in a real terminal (pexpect), `complete`, `--help`, `--version`."""
from __future__ import annotations

import subprocess
import sys

import pexpect
import pytest

from conftest import API_KEY

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def test_chat_two_turns_and_ctrl_c_in_a_terminal(server):
    child = pexpect.spawn(CLI[0], CLI[1:] + ["chat", "--url", server.url, "--api-key", API_KEY,
                                             "--temperature", "0", "--max-tokens", "24"],
                          encoding="utf-8", timeout=120)
    try:
        child.expect("chat ready")
        child.expect("> ")
        child.sendline("What is the capital of France? Answer in one word.")
        child.expect("Paris")
        child.expect("> ")
        child.sendline("And of Japan?")  # the second turn sees the first (history is sent)
        child.expect("Tokyo")
        child.expect("> ")
        child.sendline("Count from 1 to 100, one number per line.")
        child.expect("1")
        child.sendintr()  # Ctrl-C stops the reply, not the program
        child.expect(r"\[stopped\]")
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_complete_from_stdin_against_the_server(server):
    proc = subprocess.run(CLI + ["complete", "--url", server.url, "--api-key", API_KEY,
                                 "--temperature", "0", "--max-tokens", "8"],
                          input="The capital of France is", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.parametrize("command", ["serve", "chat", "complete", "doctor"])
def test_every_subcommand_has_help(command):
    proc = subprocess.run(CLI + [command, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: pagedllm" in proc.stdout


def test_version():
    proc = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("pagedllm ")
