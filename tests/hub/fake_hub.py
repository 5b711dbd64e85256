"""A loopback HTTP server speaking enough of the Hugging Face Hub's API for huggingface_hub's downloads."""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

_CHUNK = 1 << 20
_RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class FakeRepo:
    """One model repo: repo path -> local file, and whether it needs a token."""

    files: dict[str, Path]
    gated: bool = False
    sha: str = ""

    def __post_init__(self) -> None:
        if not self.sha:
            digest = hashlib.sha1(json.dumps(sorted(self.files)).encode())
            self.sha = digest.hexdigest()  # 40 hex digits, like a git commit


@dataclass(frozen=True)
class LoggedRequest:
    """One request the server answered: method, repo-relative file (or API path), Range header."""

    method: str
    path: str
    range: Optional[str]


@dataclass
class _State:
    """What the handler threads share."""

    repos: dict[str, FakeRepo]
    token: str
    log: list[LoggedRequest] = field(default_factory=list)
    cuts: dict[str, int] = field(default_factory=dict)  # file path -> bytes to send before cutting once
    lock: threading.Lock = field(default_factory=threading.Lock)


def _etag(path: Path) -> str:
    """A cheap stable ETag (hashing 500 MB per test run would dominate its time)."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    """Routes /api/models/... and /{repo}/resolve/{rev}/{file}."""

    protocol_version = "HTTP/1.0"
    state: _State  # set on the subclass made per server

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", send_body: bool = True) -> None:
        self.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, extra: Optional[dict[str, str]] = None) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(status, {"X-Error-Code": code, "X-Error-Message": code,
                            "Content-Type": "application/json", **(extra or {})}, body)

    def _repo(self, repo_id: str) -> Optional[FakeRepo]:
        """The repo if it exists and the caller may see it; else answers the error and returns None."""
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound")
            return None
        if repo.gated and self.headers.get("Authorization") != f"Bearer {self.state.token}":
            self._error(401, "GatedRepo")
            return None
        return repo

    def _route(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.state.lock:
            self.state.log.append(LoggedRequest(self.command, path, self.headers.get("Range")))
        if path.startswith("/api/models/"):
            self._api(path[len("/api/models/"):])
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m is None:
            self._error(404, "NotFound")
            return
        repo = self._repo(m.group(1))
        if repo is not None and self._revision_ok(repo, m.group(2)):
            self._file(repo, m.group(3), body)

    def _revision_ok(self, repo: FakeRepo, rev: str) -> bool:
        if rev in ("main", repo.sha):
            return True
        self._error(404, "RevisionNotFound")
        return False

    def _api(self, rest: str) -> None:
        m = re.match(r"^([^/]+/[^/]+?)(?:/(revision|tree)/([^/]+)(?:/.*)?)?$", rest)
        if m is None:
            self._error(404, "NotFound")
            return
        repo = self._repo(m.group(1))
        if repo is None or not self._revision_ok(repo, m.group(3) or "main"):
            return
        if m.group(2) == "tree":
            entries = [{"type": "file", "path": p, "size": f.stat().st_size, "oid": _etag(f)[:40]}
                       for p, f in sorted(repo.files.items())]
            self._send(200, {"Content-Type": "application/json"}, json.dumps(entries).encode())
            return
        info = {"id": m.group(1), "modelId": m.group(1), "sha": repo.sha, "private": False,
                "gated": "auto" if repo.gated else False,
                "siblings": [{"rfilename": p, "size": f.stat().st_size, "blobId": _etag(f)[:40]}
                             for p, f in sorted(repo.files.items())]}
        self._send(200, {"Content-Type": "application/json"}, json.dumps(info).encode())

    def _file(self, repo: FakeRepo, name: str, body: bool) -> None:
        local = repo.files.get(name)
        if local is None:
            self._error(404, "EntryNotFound", {"X-Repo-Commit": repo.sha})
            return
        size = local.stat().st_size
        start, end, status = 0, size, 200
        m = _RANGE_RE.match(self.headers.get("Range") or "")
        if m:
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            status = 206
        self.send_response(status)
        headers = {"ETag": f'"{_etag(local)}"', "X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes",
                   "Content-Length": str(end - start), "Content-Type": "application/octet-stream"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self._stream(local, name, start, end)

    def _stream(self, local: Path, name: str, start: int, end: int) -> None:
        with self.state.lock:
            cut = self.state.cuts.pop(name, None)
        stop = end if cut is None else min(end, start + cut)
        with open(local, "rb") as fh:
            fh.seek(start)
            pos = start
            while pos < stop:
                chunk = fh.read(min(_CHUNK, stop - pos))
                self.wfile.write(chunk)
                pos += len(chunk)
        if cut is not None:  # drop the connection mid-body, as a flaky network would
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


class FakeHub:
    """A threaded Hub look-alike on 127.0.0.1 with a random port; use as a context manager."""

    def __init__(self, repos: dict[str, FakeRepo], token: str = "hf_test_token") -> None:
        self.state = _State(repos=repos, token=token)
        handler = type("BoundHandler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The endpoint to put in HF_ENDPOINT."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def log(self) -> list[LoggedRequest]:
        """Every request so far, in arrival order."""
        with self.state.lock:
            return list(self.state.log)

    def clear_log(self) -> None:
        """Forget the requests logged so far."""
        with self.state.lock:
            self.state.log.clear()

    def cut_once(self, name: str, after_bytes: int) -> None:
        """The next GET of file `name` drops the connection after `after_bytes` bytes."""
        with self.state.lock:
            self.state.cuts[name] = after_bytes

    def files_requested(self, repo_id: str, method: str = "GET") -> list[str]:
        """Repo-relative paths of the files fetched from one repo with `method`."""
        prefix = f"/{repo_id}/resolve/"
        return [r.path[len(prefix):].split("/", 1)[1] for r in self.log
                if r.method == method and r.path.startswith(prefix)]

    def start(self) -> "FakeHub":
        """Start serving in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def closed_port() -> int:
    """A loopback port with nothing listening on it (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
