"""Bounded work per request, on a real server run inside a 3.49 GiB memory cgroup (where this
machine lets the tests make one): 20 MB bodies get a quick 413 without the server's memory
growing, over-long prompts a 400 before tokenizing, stalled and half-open connections a 408 or
a close after --request-read-timeout, and every error OpenAI's error object."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from conftest import API_KEY, Server

CGROUP_LIMIT = int(3.49 * (1 << 30))  # the cgroup the 20 MB /tokenize was OOM-killed in
READ_TIMEOUT_S = 2.0
BIG = 20_000_000
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _memory_cgroup(name: str) -> tuple[Optional[Path], str]:
    """A cgroup-v1 memory cgroup under this process's own, limited to CGROUP_LIMIT, or None and
    why not."""
    try:
        with open("/proc/self/cgroup") as fh:
            own = next(line.split(":", 2)[2].strip() for line in fh
                       if line.split(":")[1] == "memory")
        path = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / name
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(CGROUP_LIMIT))
        return path, ""
    except StopIteration:
        return None, "no cgroup-v1 memory controller in /proc/self/cgroup"
    except OSError as err:
        return None, f"cannot make a memory cgroup here: {err}"


@pytest.fixture(scope="module")
def cgroup():
    path, why = _memory_cgroup(f"pagedllm-bounds-{os.getpid()}")
    yield path, why
    if path is not None:
        for _ in range(50):  # the server's exit empties it a moment after it is reaped
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.fixture(scope="module")
def bounded(smollm_gguf, cgroup):
    path, _ = cgroup
    join = None if path is None else (
        lambda: (path / "cgroup.procs").write_text(str(os.getpid())))
    srv = Server("--api-key", API_KEY, "--quantization", "none", "--max-num-seqs", "4",
                 "--request-read-timeout", str(READ_TIMEOUT_S), preexec_fn=join)
    yield srv
    srv.stop()


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status memory field in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        line = next(line for line in fh if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS


class _HealthProbe:
    """GET /health every 50 ms on a thread: each answer's status and the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.statuses, self.slowest = url, [], 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.statuses.append(httpx.get(f"{self.url}/health", timeout=30).status_code)
            except httpx.HTTPError as err:
                self.statuses.append(repr(err))
            self.slowest = max(self.slowest, time.monotonic() - t0)
            self._stop.wait(0.05)


def _error(response: httpx.Response, status: int) -> dict:
    """OpenAI's error object of a response that must have `status`."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_20mb_bodies_get_413_quickly_and_the_server_stays_healthy(bounded):
    pid = bounded.proc.pid
    body = json.dumps({"prompt": "hello world " * (BIG // 12)}).encode()
    chunked = (body[i:i + (1 << 16)] for i in range(0, len(body), 1 << 16))
    _reset_peak_rss(pid)
    rss_before = _status(pid, "VmRSS")
    with _HealthProbe(bounded.url) as probe:
        for path, content in (("/tokenize", body), ("/v1/completions", body),
                              ("/tokenize", chunked)):  # no Content-Length: counted as read
            t0 = time.monotonic()
            r = httpx.post(f"{bounded.url}{path}", content=content, timeout=60,
                           headers={**HEADERS, "Content-Type": "application/json"})
            elapsed = time.monotonic() - t0
            assert "--max-request-body-bytes" in _error(r, 413)["message"]
            assert elapsed < 10, (path, elapsed)
    growth = _status(pid, "VmHWM") - rss_before
    print(f"20 MB bodies: peak RSS growth {growth / 2**20:.1f} MiB, /health slowest "
          f"{probe.slowest:.2f} s over {len(probe.statuses)} probes")
    assert growth < 2 * BIG  # nothing near the body's size was ever held, let alone tokenized
    assert probe.statuses and set(probe.statuses) == {200}
    assert bounded.proc.poll() is None and httpx.get(f"{bounded.url}/health").status_code == 200


def test_the_server_ran_inside_a_3_49_gib_memory_cgroup(bounded, cgroup):
    path, why = cgroup
    if path is None:
        pytest.skip(f"no memory cgroup: {why}")
    assert str(bounded.proc.pid) in (path / "cgroup.procs").read_text().split()
    assert int((path / "memory.limit_in_bytes").read_text()) <= CGROUP_LIMIT
    peak = int((path / "memory.max_usage_in_bytes").read_text())
    assert "oom_kill 0" in (path / "memory.oom_control").read_text()
    print(f"cgroup peak usage {peak / 2**30:.2f} GiB of {CGROUP_LIMIT / 2**30:.2f}")


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(bounded):
    pid = bounded.proc.pid
    huge = "hello world " * 250_000  # 3 MB: under the body limit, 37k+ tokens at the least
    _reset_peak_rss(pid)
    rss_before = _status(pid, "VmRSS")
    for path in ("/tokenize", "/v1/completions"):
        t0 = time.monotonic()
        r = httpx.post(f"{bounded.url}{path}", headers=HEADERS, timeout=60,
                       json={"prompt": huge, "max_tokens": 1})
        error = _error(r, 400)
        assert error["param"] == "prompt" and "characters long" in error["message"]
        assert time.monotonic() - t0 < 5
    t0 = time.monotonic()  # a chat message: refused before the template renders it
    r = httpx.post(f"{bounded.url}/v1/chat/completions", headers=HEADERS, timeout=60,
                   json={"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": huge}], "max_tokens": 1})
    error = _error(r, 400)
    assert error["param"] == "messages[1].content" and "characters long" in error["message"]
    assert time.monotonic() - t0 < 5
    # tokenizing 3 MB would take ~500 MB (measured: 4 MB, 690 MB); the check takes none
    assert _status(pid, "VmHWM") - rss_before < 100 << 20


def test_tokenizing_runs_off_the_event_loop(bounded):
    # 600k characters fit the character bound (~660k), so they are tokenized: 300k tokens, >
    # 8192. With the tokenizing on the event loop, the slowest /health answer was 0.43-0.83 s of
    # 0.54-0.83 (a mutation, here); off it, 0.05-0.09 s. Two tries: one stall of this VM (0.71 s
    # of 1.34 once, in a CI run) fails one try, the tokenizing on the loop fails both.
    tries = []
    for _ in range(2):
        with _HealthProbe(bounded.url) as probe:
            t0 = time.monotonic()
            r = httpx.post(f"{bounded.url}/v1/completions", headers=HEADERS, timeout=60,
                           json={"prompt": "a " * 300_000, "max_tokens": 1})
            took = time.monotonic() - t0
        assert "300001 tokens long" in _error(r, 400)["message"]
        assert set(probe.statuses) == {200}, probe.statuses
        print(f"tokenizing 600k characters: {took:.2f} s; /health slowest {probe.slowest:.2f} s")
        tries.append((probe.slowest, took))
        if probe.slowest < max(0.25, took / 3):
            return
    pytest.fail(f"/health waited on the tokenizing in both tries (slowest, took): {tries}")


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    sock.settimeout(limit_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_shorter_than_its_content_length_gets_408_and_a_close(bounded):
    sock = socket.create_connection(("127.0.0.1", bounded.port))
    t0 = time.monotonic()
    sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                 API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    data = _read_until_closed(sock, 4 * READ_TIMEOUT_S)
    took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == 408
    assert READ_TIMEOUT_S - 0.1 < took < READ_TIMEOUT_S + 2
    sock.close()


def test_half_open_connections_are_closed_after_the_read_timeout(bounded):
    starts = [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n",  # nothing; half the headers
              b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"]  # body unsent
    socks = []
    for i in range(3000):
        sock = socket.create_connection(("127.0.0.1", bounded.port))
        sock.sendall(starts[i % 3])
        socks.append(sock)
    opened = time.monotonic()
    assert httpx.get(f"{bounded.url}/health", timeout=10).status_code == 200
    open_socks = set(socks)
    while open_socks and time.monotonic() - opened < READ_TIMEOUT_S + 5:
        time.sleep(0.2)
        for sock in list(open_socks):
            sock.setblocking(False)
            try:
                while sock.recv(65536):  # the 200 of the request whose body never came
                    pass
            except BlockingIOError:
                continue
            except ConnectionError:
                pass
            open_socks.discard(sock)
    closed_after = time.monotonic() - opened
    for sock in socks:
        sock.close()
    print(f"3000 half-open connections closed {closed_after:.1f} s after opening")
    assert not open_socks, f"{len(open_socks)} of 3000 still open"
    assert httpx.get(f"{bounded.url}/health").status_code == 200


@pytest.mark.parametrize("name,path,content,status,param", [
    ("unparsable", "/v1/completions", b'{"prompt": ', 400, None),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff"}', 400, None),
    ("100k nested lists", "/v1/completions",
     b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("lone surrogate, completions", "/v1/completions", rb'{"prompt": "a\ud800"}', 400,
     "prompt"),
    ("lone surrogate, a prompt list", "/v1/completions", rb'{"prompt": ["ok", "a\udfff"]}',
     400, "prompt[1]"),
    ("lone surrogate, tokenize", "/tokenize", rb'{"prompt": "a\ud800"}', 400, "prompt"),
    ("lone surrogate, chat", "/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": "a\ud800"}]}', 400, "messages[0].content"),
    ("lone surrogate, model", "/v1/completions", rb'{"prompt": "a", "model": "\ud800"}', 400,
     "model"),
    ("lone surrogate, a key", "/v1/completions", rb'{"prompt": "a", "\ud800": 1}', 400, "body"),
    ("NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("seed past 64 bits", "/v1/completions", b'{"prompt": "a", "seed": ' + b"9" * 30 + b'}', 400,
     "seed"),
    ("no such path", "/v1/no-such-endpoint", b"{}", 404, None),
])
def test_every_error_is_openai_error_object(bounded, name, path, content, status, param):
    r = httpx.post(f"{bounded.url}{path}", content=content, timeout=30,
                   headers={**HEADERS, "Content-Type": "application/json"})
    error = _error(r, status)
    assert error["param"] == param, (name, error)
    if "surrogate" in name:
        assert "lone surrogate" in error["message"]
    if "nested" in name:
        assert "too deeply" in error["message"]


def test_routing_auth_and_malformed_http_errors_are_openai_error_objects(bounded):
    r = httpx.get(f"{bounded.url}/v1/chat/completions", headers=HEADERS)
    _error(r, 405)
    r = httpx.post(f"{bounded.url}/tokenize", json={"prompt": "a"})  # no key
    assert _error(r, 401)["type"] == "authentication_error"
    sock = socket.create_connection(("127.0.0.1", bounded.port))
    sock.sendall(b"NOT HTTP\x00\r\n\r\n")  # h11 refuses it; uvicorn answers
    head, _, body = _read_until_closed(sock, 5).partition(b"\r\n\r\n")
    sock.close()
    assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["code"] == 400


@pytest.mark.parametrize("flag,value,message", [
    ("--max-request-body-bytes", "0", "max_body_bytes must be >= 1, got 0"),
    ("--request-read-timeout", "0", "read_timeout_s must be > 0, got 0.0"),
    # the slot limits (test_fair_slots.py)
    ("--max-client-share", "0", "max_client_share must be in (0, 1], got 0.0"),
    ("--max-stream-backlog", "0", "max_stream_backlog must be >= 1, got 0"),
    ("--send-stall-timeout", "0", "send_stall_timeout_s must be > 0, got 0.0"),
])
def test_bad_limits_stop_serve_before_loading(flag, value, message):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", flag, value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"pagedllm serve: error: {message}" in proc.stderr
