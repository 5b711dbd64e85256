"""The command line: `pagedllm chat` in a real terminal (pexpect), `complete`, `--help`, `--version`."""
from __future__ import annotations

import subprocess
import sys

import pexpect
import pytest

from conftest import API_KEY

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def _chat(server, max_tokens: int) -> pexpect.spawn:
    child = pexpect.spawn(CLI[0], CLI[1:] + ["chat", "--url", server.url, "--api-key", API_KEY,
                                             "--temperature", "0", "--max-tokens",
                                             str(max_tokens)],
                          encoding="utf-8", timeout=120)
    child.expect("chat ready")
    child.expect("\n> ")
    return child


def _say(child: pexpect.spawn, line: str) -> None:
    child.sendline(line)
    child.expect_exact(line + "\r\n")  # the terminal's echo of what was typed


def test_chat_two_turns_in_a_terminal(server):
    child = _chat(server, 24)
    try:
        _say(child, "What is the capital of France? Answer in one word.")
        child.expect("Paris")
        child.expect("\n> ")
        _say(child, "And of Japan?")  # the second turn sees the first (history is sent)
        child.expect("Tokyo")
        child.expect("\n> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_not_the_chat(server):
    child = _chat(server, 1500)
    try:
        _say(child, "Tell me a very long story about a dragon and a knight.")
        child.expect(r"\w+ \w+")  # the reply is streaming
        child.sendintr()
        child.expect(r"\[stopped\]")
        child.expect("\n> ")  # the chat goes on: a new prompt, history kept
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
