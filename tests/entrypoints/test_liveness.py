"""Liveness of `pagedllm serve` on real SmolLM2 servers: a rank stopped with SIGSTOP under
-pp 2, and a real step past a test-short step deadline, each turn /health into 503 with the
reason, end the open stream with an error event and [DONE], and make serve exit 1 with no
process left; SIGTERM drains: new requests 503, short streams finish, the rest end with an
error event and [DONE] at --shutdown-timeout, and serve exits 0."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Optional

import httpx
import psutil

from conftest import Server

DEADLINE_S = 60  # a hang fails the test instead of blocking the suite


class Stream:
    """A streaming completion read on a thread: its data lines, and when the first came."""

    def __init__(self, url: str, body: dict, path: str = "/v1/completions") -> None:
        self.lines: list[str] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url + path, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json={**body, "stream": True},
                          timeout=DEADLINE_S) as resp:
            for line in resp.iter_lines():
                if line:
                    self.lines.append(line)
                    self.first.set()

    def events(self) -> list:
        """The JSON events, then "[DONE]" if it came; waits for the stream to end."""
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the stream did not end"
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                for line in self.lines]


def _until_unhealthy(srv: Server, seconds: float = DEADLINE_S) -> tuple[float, Optional[dict]]:
    """Poll /health until it answers 503 (or the server exits, or `seconds` pass): (seconds,
    its body)."""
    started = time.monotonic()
    while srv.proc.poll() is None and time.monotonic() - started < seconds:
        try:
            r = httpx.get(f"{srv.url}/health", timeout=5)
            if r.status_code == 503:
                return time.monotonic() - started, r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return time.monotonic() - started, None


def _gone(pids: list[int], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def _assert_failed_with(events: list, words: str) -> None:
    """Tokens may have come; then one error event naming `words`, then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert words in error["message"], error


def test_a_stopped_rank_turns_health_503_and_serve_exits_1(tmp_path):
    srv = Server("-pp", "2", "--max-model-len", "512", "--step-timeout", "2")
    ranks = [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True)]
    try:
        assert len(ranks) == 2, srv.log_tail()
        # past the first steps, which get four times the deadline
        httpx.post(f"{srv.url}/v1/completions", timeout=DEADLINE_S,
                   json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
        stream = Stream(srv.url, {"prompt": "Once upon a time", "max_tokens": 400,
                                  "ignore_eos": True})
        assert stream.first.wait(DEADLINE_S)
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        seconds, body = _until_unhealthy(srv)
        assert body is not None, srv.log_tail()
        reason = body["error"]["message"]
        assert "pipeline rank 1" in reason and f"pid {ranks[1]}" in reason, reason
        assert "stopped (SIGSTOP)" in reason and "has not answered" in reason, reason
        assert srv.proc.wait(timeout=DEADLINE_S) == 1
        exited = time.monotonic() - stopped
        print(f"SIGSTOP of rank 1, --step-timeout 2: /health 503 after {seconds:.1f} s, "
              f"exit 1 after {exited:.1f} s")
        assert seconds < 2 + 5 and exited < 20, (seconds, exited)
        _assert_failed_with(stream.events(), "pipeline rank 1")
        assert _gone(ranks), "a rank outlived the server"
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        srv.stop()


def test_a_step_past_its_deadline_turns_health_503_and_serve_exits_1():
    # a decode step of SmolLM2 takes a few ms against a 1 ms + its work at 20 GFLOP/s (~15 ms)
    # deadline, so on a fast quiet machine no step may overrun by itself: the serving process
    # is stopped for 0.4 s at a time (a stall, as a VM's stolen time or swapping makes one)
    # until a step caught inside a pause is past its deadline; the watchdog or the step's own
    # end reports it, whichever runs first
    srv = Server("--max-model-len", "1024", "--step-timeout", "0.001")
    try:
        stream = Stream(srv.url, {"prompt": "word " * 250, "max_tokens": 700,
                                  "ignore_eos": True})
        assert stream.first.wait(DEADLINE_S), srv.log_tail()
        body = None
        for _ in range(40):
            if srv.proc.poll() is not None:
                break
            srv.proc.send_signal(signal.SIGSTOP)
            time.sleep(0.4)
            srv.proc.send_signal(signal.SIGCONT)
            _, body = _until_unhealthy(srv, seconds=1.0)
            if body is not None:
                break
        if body is None:
            body = _until_unhealthy(srv)[1]
        assert body is not None, srv.log_tail()
        assert "EngineHungError" in body["error"]["message"]
        assert "past its deadline of" in body["error"]["message"] or \
            "within its deadline of" in body["error"]["message"]
        assert srv.proc.wait(timeout=DEADLINE_S) == 1
        _assert_failed_with(stream.events(), "the engine is hung")
        assert "exiting with status 1" in srv.log_tail()
    finally:
        srv.proc.send_signal(signal.SIGCONT) if srv.proc.poll() is None else None
        srv.stop()


def test_sigterm_drains_short_streams_and_ends_the_rest_with_an_error_and_done():
    srv = Server("--max-model-len", "2048", "--shutdown-timeout", "6")
    try:
        short = [Stream(srv.url, {"prompt": f"Story {i}:", "max_tokens": 24,
                                  "ignore_eos": True}) for i in range(2)]
        long = [Stream(srv.url, {"prompt": "Tale:", "max_tokens": 1500, "ignore_eos": True}),
                Stream(srv.url, {"messages": [{"role": "user", "content": "Tell a tale."}],
                                 "max_tokens": 1500, "ignore_eos": True},
                       "/v1/chat/completions")]
        plain: dict = {}
        waiter = threading.Thread(target=lambda: plain.update(r=httpx.post(
            f"{srv.url}/v1/completions", timeout=DEADLINE_S,
            json={"prompt": "Fable:", "max_tokens": 1500, "ignore_eos": True})))
        waiter.start()
        assert all(s.first.wait(DEADLINE_S) for s in short + long)
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        health = httpx.get(f"{srv.url}/health", timeout=10)
        late = httpx.post(f"{srv.url}/v1/completions", timeout=10,
                          json={"prompt": "late", "max_tokens": 4})
        assert health.status_code == 503 and "shutting down" in health.text
        assert late.status_code == 503 and late.json()["error"]["code"] == 503
        for s in short:  # every token, a finish reason, [DONE]
            events = s.events()
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"]
            assert sum("choices" in e for e in events[:-1]) >= 1
            assert not any("error" in e for e in events[:-1])
        for s in long:
            events = s.events()
            assert "choices" in events[0]  # tokens first
            _assert_failed_with(events, "--shutdown-timeout 6 s")
            assert events[-2]["error"]["code"] == 503
        waiter.join(DEADLINE_S)
        assert plain["r"].status_code == 503 and "shutting down" in plain["r"].text
        assert srv.proc.wait(timeout=DEADLINE_S) == 0
        took = time.monotonic() - sent
        print(f"SIGTERM with --shutdown-timeout 6: exit 0 after {took:.1f} s")
        assert 6 <= took < 6 + 10
        assert "requests did not finish within" in srv.log_tail()
    finally:
        srv.stop()
