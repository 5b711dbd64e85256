"""Two 3.49 GiB VMs on one machine: a Ray head node in one cgroup v1 and a worker node in
another, each started with `ray start` inside its cgroup, and `pagedllm serve ... -pp 2
--distributed-executor-backend ray` with RAY_ADDRESS in the first (as on VM A). Every process
of a VM is in its cgroup, so the cgroup's peak and OOM count are the VM's.

The commands are docs/ray_two_vms.md's recipe (RECIPE, filled in with this machine's address
and free ports); only RAY_TMPDIR (Ray's session files, kept apart from other clusters on this
machine) and PYTHONPATH (this checkout's pagedllm, in serve and in Ray's workers) are added to
the environment. Also a script for a run by hand: `python tests/platforms/two_ray_vms.py
MODEL.gguf`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SEED_VM_LIMIT = 3_750_588_416  # the seed user's VM: 3.49 GiB
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
READY_S = 900  # a first load writes each stage's regrouped copy of its blocks
# the recipe, as docs/ray_two_vms.md gives it (ray_port 6379, http_port 8000)
RECIPE = {
    "head": "ray start --head --port={ray_port}",
    "worker": "ray start --address={head_ip}:{ray_port}",
    "serve": "RAY_ADDRESS={head_ip}:{ray_port} pagedllm serve {model} -pp 2 "
             "--distributed-executor-backend ray --port {http_port}",
}


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@dataclass
class Vm:
    """A cgroup standing in for a VM, and what its processes' logs went to."""

    cgroup: Path
    logs: list[Path] = field(default_factory=list)

    def run(self, command: str, env: dict, log: Path, wait: bool) -> subprocess.Popen:
        """A command line (assignments first, as a shell takes them) inside this VM's cgroup:
        the shell joins it, then becomes the command; `ray` and `pagedllm` are this
        virtualenv's."""
        self.logs.append(log)
        proc = subprocess.Popen(["sh", "-c", f"echo $$ > {self.cgroup}/cgroup.procs && exec env "
                                 + command], env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        if wait and proc.wait(timeout=180) != 0:
            raise RuntimeError(f"{command!r} failed:\n{log.read_text()[-3000:]}")
        return proc

    def read(self, name: str) -> str:
        """One of the cgroup's files."""
        return (self.cgroup / name).read_text()

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        return [int(p) for p in self.read("cgroup.procs").split()]

    def commands(self) -> list[str]:
        """Each process's command line (Ray's workers name themselves ray::ClassName)."""
        out = []
        for pid in self.pids():
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip())
            except OSError:
                continue
        return out

    def stop(self) -> None:
        """End every process this VM's commands started (they are all in its cgroup), by pid,
        then remove the cgroup."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            for _ in range(100):
                if not self.pids():
                    break
                time.sleep(0.1)
        for _ in range(50):
            try:
                self.cgroup.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def make_vm(tag: str) -> Vm:
    """A fresh cgroup v1 with the seed VM's memory limit."""
    from cgroup_v1 import CGROUP_V1_MEMORY  # tests/ (on the path under pytest; __main__ adds it)

    cg = CGROUP_V1_MEMORY / f"pagedllm-ray-{tag}"
    cg.mkdir()
    (cg / "memory.limit_in_bytes").write_text(str(SEED_VM_LIMIT))
    return Vm(cg)


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> float:
    """Seconds until the server answers /health; raises with its log if it exits first."""
    started = time.monotonic()
    while time.monotonic() - started < READY_S:
        if server.poll() is not None:
            raise RuntimeError(f"serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"serve was not healthy in {READY_S} s:\n{log.read_text()[-4000:]}")


def serve_on_two_vms(model: Path, workdir: Path) -> dict:
    """Run the recipe, send a request through both stages, and report each VM's peak, OOM
    kills, where the ranks ran, and the serve log."""
    from ray.util import get_node_ip_address

    tag = uuid.uuid4().hex[:8]
    head, worker = make_vm(f"{tag}-a"), make_vm(f"{tag}-b")
    ip, ray_port, http_port = get_node_ip_address(), free_port(), free_port()
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="rp-", dir="/tmp"),
               PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    serve_log = workdir / "serve.log"
    try:
        os.sync()  # page cache charged to an earlier cgroup would not count here: start cold
        Path("/proc/sys/vm/drop_caches").write_text("1")
        fill = dict(ray_port=ray_port, head_ip=ip, model=model, http_port=http_port)
        head.run(RECIPE["head"].format(**fill), env, workdir / "head.log", True)
        worker.run(RECIPE["worker"].format(**fill), env, workdir / "worker.log", True)
        ray_only = {"head": head.read("memory.usage_in_bytes"),
                    "worker": worker.read("memory.usage_in_bytes")}
        server = head.run(RECIPE["serve"].format(**fill), env, serve_log, False)
        url = f"http://127.0.0.1:{http_port}"
        ready_s = wait_healthy(url, server, serve_log)
        started = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": str(model), "prompt": "The weather today is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}).json()
        request_s = time.monotonic() - started
        actors = {name: [c for c in vm.commands() if c.startswith("ray::RankActor")]
                  for name, vm in (("head", head), ("worker", worker))}
        pids = {"head": head.pids(), "worker": worker.pids()}
        server_rss = int(Path(f"/proc/{server.pid}/statm").read_text().split()[1]) * 4096
        return {"reply": reply, "ready_s": ready_s, "request_s": request_s, "actors": actors,
                "pids": pids,
                "ray_only_bytes": {k: int(v) for k, v in ray_only.items()},
                "server_rss": server_rss,
                "peak": {"head": int(head.read("memory.max_usage_in_bytes")),
                         "worker": int(worker.read("memory.max_usage_in_bytes"))},
                "oom": {"head": head.read("memory.oom_control"),
                        "worker": worker.read("memory.oom_control")},
                "log": serve_log.read_text()}
    finally:
        head.stop()
        worker.stop()
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    result = serve_on_two_vms(Path(sys.argv[1]), Path(tempfile.mkdtemp(prefix="two-vms-")))
    log = result.pop("log")
    print("\n".join(line for line in log.splitlines() if "memory plan" in line
                    or "Ray node" in line or "on Ray" in line or "rank" in line)[-6000:])
    print(json.dumps(result, indent=1))
