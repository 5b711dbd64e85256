"""Fair slots on a real server: clients that never read their socket are aborted (KV blocks freed,
a log line) and then disconnected, so that a normal request gets its first token within seconds
and memory stays flat; one client's sequences in flight are held to --max-client-share; a prompt
list longer than --max-waiting is a 400.

Clients are told apart by source address: each binds its own 127.0.0.x (the whole /8 is
loopback)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import json
import re
import socket
import time

import httpx
import pytest

from conftest import MODEL, Server

MAX_NUM_SEQS = 8
BACKLOG = 8
STALL_S = 4
MAX_WAITING = 16
# the slow-reader load, scaled down: n=4 each, echo, 20 logprobs, never ending by itself
HOG = {"model": MODEL, "prompt": "Tell me a long story about " * 8, "n": 4, "max_tokens": 2000,
       "echo": True, "logprobs": 20, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def slots(smollm_gguf):
    srv = Server("--max-num-seqs", str(MAX_NUM_SEQS), "--max-client-share", "0.5",
                 "--max-stream-backlog", str(BACKLOG), "--send-stall-timeout", str(STALL_S),
                 "--max-waiting", str(MAX_WAITING))
    yield srv
    srv.stop()


CHAT_HOG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "n": 4, "max_tokens": 2000, "logprobs": True, "top_logprobs": 20, "stream": True,
            "ignore_eos": True}


def _non_reader(srv: Server, source: str, body: dict = HOG,
                path: str = "/v1/completions") -> socket.socket:
    """A client at `source` that sends body (HOG: streaming) and never reads a byte of the
    answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), source_address=(source, 0))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) * 1024


def _wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds} s: {what}")


def _first_token_seconds(srv: Server) -> float:
    started = time.monotonic()
    body = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 4, "stream": True}
    with _client("127.0.0.1") as client, client.stream(
            "POST", f"{srv.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.monotonic() - started
    raise AssertionError("no token came")


def _closed_by_server(sock: socket.socket) -> bool:
    """The server has closed (reset) this connection: reading reaches its end."""
    sock.settimeout(5)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def test_clients_that_do_not_read_are_aborted_and_a_normal_request_gets_through(slots):
    # two clients (n=4 each, their whole share; completions and chat) fill every sequence slot
    # and never read
    before = _rss(slots.proc.pid)
    socks = [_non_reader(slots, "127.0.0.2"),
             _non_reader(slots, "127.0.0.3", CHAT_HOG, "/v1/chat/completions")]
    try:
        _wait_for(lambda: slots.metrics()["vllm:num_requests_running"] == MAX_NUM_SEQS, 60,
                  "the non-readers hold every slot")
        ttft = _first_token_seconds(slots)
        print(f"first token of a normal request behind 2 non-readers: {ttft:.2f} s")
        assert ttft < 15  # before: after the non-readers' 2000 tokens (minutes)
        aborted = _wait_for(lambda: len(set(re.findall(
            r"request ((?:chat)?cmpl-\w+-0): aborted: its client has not taken its last "
            rf"\d+ outputs \(--max-stream-backlog {BACKLOG}\)", slots.log_tail(20000)))) == 2, 30,
            "an abort line for each non-reader")
        assert aborted
        assert slots.wait_idle()["vllm:kv_cache_usage_perc"] == 0  # their blocks are free
        # then each stalled connection is closed: nothing of it stays in the server
        closed = _wait_for(lambda: len(re.findall(
            r"client 127\.0\.0\.[23]:\d+ \(POST /v1/(?:chat/)?completions\): disconnected: "
            rf"it took no response bytes for {STALL_S} s \(--send-stall-timeout\)",
            slots.log_tail(20000))) == 2, STALL_S + 20, "a disconnect line for each non-reader")
        assert closed
        assert all(_closed_by_server(s) for s in socks)
        # nothing of theirs grows any more (before: ~15 MB/s of queued outputs and logprobs)
        rss = _rss(slots.proc.pid)
        time.sleep(3)
        grown = _rss(slots.proc.pid) - rss
        print(f"server RSS {before / 2**20:.0f} MB before the non-readers, {rss / 2**20:.0f} MB "
              f"once they are gone, 3 s later {grown / 2**20:+.1f} MB")
        assert grown < 10 << 20
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{slots.url}/health").status_code == 200


def test_one_clients_sequences_are_held_to_its_share(slots):
    cap = MAX_NUM_SEQS // 2
    short = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    # a non-streaming request of cap sequences: in flight until it ends or its client goes
    held = _non_reader(slots, "127.0.0.4", {**HOG, "stream": False, "echo": False,
                                            "logprobs": None, "n": cap})
    with _client("127.0.0.4") as a, _client("127.0.0.5") as b:
        try:
            _wait_for(lambda: slots.metrics()["vllm:num_requests_running"] == cap, 30,
                      "the held request runs")
            # past its share, a's next request waits for a's own sequences, not b's
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(a.post, f"{slots.url}/v1/completions", json=short)
                assert b.post(f"{slots.url}/v1/completions", json=short).status_code == 200
                time.sleep(1.0)
                assert not waiting.done()
                assert slots.metrics()["vllm:num_requests_running"] == cap
                held.close()  # its client gone, the held request's sequences are given back
                assert waiting.result(timeout=30).status_code == 200
        finally:
            held.close()
        r = b.post(f"{slots.url}/v1/completions", json={**short, "n": cap + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = b.post(f"{slots.url}/v1/completions", json={**short, "prompt": ["a"] * (cap + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_prompt_list_longer_than_the_waiting_limit_is_a_400(slots):
    body = {"model": MODEL, "prompt": ["Hello"] * (MAX_WAITING + 1), "max_tokens": 1}
    r = httpx.post(f"{slots.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"at most {MAX_WAITING} requests (--max-waiting)" in \
        err["message"]
