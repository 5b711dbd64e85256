"""What the executor tests share: generate with a rank killed under it, processes gone, a
server brought up, one process that schedules as pipeline parallelism does."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import httpx
import psutil
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.executor.uniproc import UniProcExecutor

DEADLINE_S = 120  # a hang fails the test instead of blocking the suite


def gone(pids: list[int]) -> bool:
    """None of the processes is left (a zombie not reaped yet counts as gone)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def kill_mid_generation(llm: LLM, prompts: list[str], pid: int, max_tokens: int = 200,
                        sig: int = signal.SIGKILL) -> Optional[BaseException]:
    """Run generate over prompts in a thread, send pid `sig` (SIGKILL; SIGSTOP: a hung rank)
    once a step has run, and return what generate raised (None if it returned); generate must
    end within DEADLINE_S."""
    result: dict = {}

    def generate() -> None:
        try:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True), use_tqdm=False)
        except BaseException as err:  # what the tests check
            result["error"] = err

    runner = threading.Thread(target=generate, daemon=True)
    runner.start()
    while not len(llm.llm_engine.engine_core.scheduler.running) and runner.is_alive():
        time.sleep(0.05)  # until a step has run
    time.sleep(0.3)
    os.kill(pid, sig)
    runner.join(DEADLINE_S)
    assert not runner.is_alive(), f"generate hung after pid {pid} got signal {sig}"
    return result.get("error")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until the server at url answers /health with 200 (its log in the failure if it exits)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)


class TwoBatchesInProcess(UniProcExecutor):
    """The whole model in this process, with the engine core keeping two batches in flight as
    it does for pipeline_parallel_size=2: the schedule depends only on the batch queue, not on
    timing, so this process runs exactly PP=2's schedule (each batch computed when submitted).
    The reference where tokens depend on the schedule (quantized kernels near a tie, logprobs
    compared exactly)."""

    @property
    def max_concurrent_batches(self) -> int:
        return 2


@contextmanager
def one_process_scheduled_as_pp2(monkeypatch, **llm_kwargs) -> Iterator[LLM]:
    """An LLM over TwoBatchesInProcess, run with the torch threads each PP=2 rank has (half of
    this process's): a few ops round in the last bits by thread count, which a quantized
    activation can turn into a visible logprob difference."""
    threads = torch.get_num_threads()
    with monkeypatch.context() as patch:
        patch.setattr("pagedllm.engine.engine_core.default_executor_class",
                      lambda parallel: TwoBatchesInProcess)
        llm = LLM(**llm_kwargs)
    torch.set_num_threads(max(1, threads // 2))
    try:
        yield llm
    finally:
        torch.set_num_threads(threads)
