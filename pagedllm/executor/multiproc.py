"""The multiprocess executor: one worker process per rank (pipeline stage or tensor parallel
rank) on this machine.

    engine process                      rank 0 (layers 0..k-1)     rank 1 (layers k..n-1)
    MultiprocExecutor --pipe: call -->  Worker                     Worker
                      --pipe: call ------------------------------> Worker
                                        --- torch.distributed send/recv (gloo) --->
                      <--pipe: reply -- (empty)                    ModelRunnerOutput

Control (each step's SchedulerOutput, the KV sizing calls) goes to every rank over its own
pipe, so all ranks keep the same request state; activations go stage to stage over a gloo
process group; the last rank's reply is the step's output. A rank that dies is seen by its
pipe or its process, and the executor then fails with the rank named, instead of waiting. A
rank that stays alive but does not answer a step within its deadline (executor/deadline.py:
stopped by SIGSTOP, or hung) fails it the same way, and every rank is then killed: a stopped
process would never act on a request to stop.

Up to pipeline_parallel_size steps are in flight (execute_model_async): each rank serves its
calls in order, so rank 0 computes step k+1 while rank 1 still computes step k, and the
replies of each pipe come back in step order, read oldest step first. Every rank learns the
tokens sampled since from the next step's SchedulerOutput (CachedRequestData's new token ids):
the scheduler never puts a request in two steps in flight, so a request's token is known
before the request is scheduled again.

With tensor_parallel_size=N instead, every rank runs every step on its share of each layer,
the collectives (all-reduce, all-gather) joining them over the same gloo group; rank 0's reply
is the step's output. With both,
tensor_parallel_size x pipeline_parallel_size ranks: each stage's TP ranks join in a TP group
of their own, each sends to the same TP rank of the next stage, and TP rank 0 of the last
stage replies (distributed/parallel_groups.py has the layout).

Modules: rank_places.py (where each rank goes), rank_loop.py (a rank's start, its main loop and
the pipe's protocol), this one (the executor: the processes, their pipes, failures); each rank's
memory (PAGEDLLM_RANK_CGROUP) is memory/rank_memory.py's. The Ray executor uses the first two.

A rank is a fresh Python process (executor/rank_process.py) with its end of a socket pair and
this process's sys.path, not a multiprocessing "spawn" child: spawn re-runs the user's main
script in every child, so a script without an `if __name__ == "__main__":` guard would start
engines without end. Messages are plain pickles (tensors by value), which need no shared
authentication key.

PAGEDLLM_RANK_CGROUP puts each rank in its own memory cgroup, a machine of its own as far as
memory goes: a cgroup directory with a `{rank}` placeholder (/sys/fs/cgroup/memory/pp{rank} on
cgroup v1, /sys/fs/cgroup/pp{rank} on v2), made beforehand by whoever sets the variable. A rank
writes its pid into the directory's cgroup.procs first thing, before it imports torch or loads
anything; the planner then plans each rank's share against its cgroup's limit instead of
planning all ranks' sum against this machine, and each rank checks its share again against
the limit it reads where it runs, refusing (with the rank named) before it loads a weight.
"""
from __future__ import annotations

import json
import logging
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Optional

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor, WorkerDiedError, WorkerError
from pagedllm.executor.deadline import (StepDeadlines, WorkerHungError, hung_message,
                                        process_stopped)
from pagedllm.executor.rank_loop import WorkerCall, WorkerReply, recv, send
from pagedllm.executor.rank_places import (RankPlace, parallel_kind, partition_note,
                                           places_driver, rank_places)
from pagedllm.executor.step_queue import PendingStep, StepQueue
from pagedllm.memory.rank_memory import rank_cgroup

logger = logging.getLogger("pagedllm")

POLL_S = 0.5  # how often a wait on a rank's reply checks that the rank is still alive
STOP_S = 10.0  # how long shutdown waits for a rank to exit before it is killed
# a step call larger than this is sent only once every reply before it is read: a rank busy
# writing a large reply to a full pipe would never read a large call the engine is blocked on
BIG_CALL_BYTES = 64 * 2**10


@dataclass
class _Rank:
    """A worker process and the engine's end of its pipe."""

    place: RankPlace
    process: subprocess.Popen
    conn: Connection

    def alive(self) -> bool:
        """The process has not exited."""
        return self.process.poll() is None


def _start_rank(config: EngineConfig, place: RankPlace, init_method: str) -> _Rank:
    """A rank's process with its end of a socket pair, given its config and place."""
    ours, theirs = socket.socketpair()
    # the child imports with this process's sys.path, in its order: `python -m` would put the
    # working directory first, where another checkout's pagedllm may shadow this one
    # a rank with a cgroup of its own joins it first: before torch, before any page is touched
    bootstrap = ("import json, os, sys\n"
                 "if sys.argv[3]:\n"
                 "    with open(os.path.join(sys.argv[3], 'cgroup.procs'), 'w') as f:\n"
                 "        f.write(str(os.getpid()))\n"
                 "sys.path[:] = json.loads(sys.argv[2])\n"
                 "from pagedllm.executor.rank_process import main; main(int(sys.argv[1]))")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", bootstrap, str(theirs.fileno()), json.dumps(sys.path),
             rank_cgroup(place.rank) or ""], pass_fds=(theirs.fileno(),))
    finally:
        theirs.close()  # the child holds its end: its death closes the pipe here
    rank = _Rank(place, proc, Connection(ours.detach()))
    send(rank.conn, (config, place, init_method))
    return rank


def _stop_ranks(ranks: list[_Rank], store_dir: str) -> None:
    """Ask each live rank to stop, then terminate (and at last kill) what is still running;
    safe to call twice. A module function, so weakref.finalize holds no executor."""
    for r in ranks:
        if r.alive():
            try:
                send(r.conn, WorkerCall("shutdown"))
            except OSError:
                pass
    for r in ranks:
        for stop in (None, r.process.terminate, r.process.kill):
            if stop is not None and r.alive():
                stop()
            try:
                r.process.wait(timeout=STOP_S)
                break
            except subprocess.TimeoutExpired:
                continue
        r.conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)


class MultiprocExecutor(Executor):
    """One Worker process per rank, joined by a gloo process group."""

    def _init_executor(self) -> None:
        places = rank_places(self.config)
        self._driver = places_driver(places)  # TP rank 0 of the last stage samples
        self._failure: Optional[RuntimeError] = None  # once set, every call raises it again
        self._steps = StepQueue(self._take_oldest)  # steps sent, replies unread
        self._deadlines = StepDeadlines(self.config)
        # a file store: no port to find free and no port race between two engines
        self._store_dir = tempfile.mkdtemp(prefix="pagedllm-pg-")
        init_method = Path(self._store_dir, "store").as_uri()
        self._ranks: list[_Rank] = []
        self._finalizer = weakref.finalize(self, _stop_ranks, self._ranks, self._store_dir)
        try:
            for place in places:
                self._ranks.append(_start_rank(self.config, place, init_method))
            self._decode_paths = self._gather()
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s parallel%s: %s", parallel_kind(places), partition_note(places),
                    ", ".join(f"rank {r.place.rank} (pid {r.process.pid}){r.place.layers}"
                              for r in self._ranks))

    # ---- calls --------------------------------------------------------------
    def _send(self, rank: _Rank, call: WorkerCall) -> None:
        self._send_bytes(rank, pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, rank: _Rank, payload: bytes) -> None:
        try:
            rank.conn.send_bytes(payload)
        except OSError:
            self._died(rank)

    def _gather(self, deadline_s: Optional[float] = None) -> list[Any]:
        """Every rank's answer to its last call, in rank order, taken as they come: a rank
        that fails is seen at once even while another waits on it in a send or receive.
        deadline_s: the longest wait for the next answer (a step's); None: no limit."""
        pending = {r.conn: r for r in self._ranks}
        values: dict[int, Any] = {}
        since = time.monotonic()  # the last answer (or the start)
        while pending:
            left = None if deadline_s is None else since + deadline_s - time.monotonic()
            for conn in wait(list(pending), timeout=POLL_S if left is None
                             else max(0.0, min(POLL_S, left))):
                rank = pending.pop(conn)
                values[rank.place.rank] = self._read(rank)
                since = time.monotonic()
            for rank in pending.values():
                if not rank.alive():
                    self._died(rank)
            if pending and deadline_s is not None and time.monotonic() - since >= deadline_s:
                self._hung(list(pending.values()), time.monotonic() - since, deadline_s)
        return [values[r.place.rank] for r in self._ranks]

    def _hung(self, pending: list[_Rank], waited: float, deadline_s: float) -> None:
        """Fail the executor for ranks that did not answer in time: name a stopped one if
        there is one (its peers only wait on it), else the first; kill them all."""
        stopped = [r for r in pending if process_stopped(r.process.pid)]
        rank = (stopped or pending)[0]
        state = " is stopped (SIGSTOP) and" if stopped else ""
        for r in self._ranks:  # SIGKILL: a stopped process acts on nothing else
            if r.alive():
                r.process.kill()
        self._fail(WorkerHungError(hung_message(
            f"worker process of {rank.place.name} (pid {rank.process.pid})", waited,
            deadline_s, state)))

    def _read(self, rank: _Rank) -> Any:
        """A rank's ready reply; a rank that failed fails the executor (the ranks' request
        states may differ after it)."""
        try:
            reply: WorkerReply = recv(rank.conn)
        except (EOFError, OSError):
            self._died(rank)
        if reply.error is not None:
            # a rank whose peer was killed fails in its collective: the death is the cause to
            # report (a rank that failed itself answers first, then exits with code 0)
            dead = next((r for r in self._ranks
                         if r is not rank and r.process.poll() not in (None, 0)), None)
            if dead is not None:
                self._died(dead)
            self._fail(WorkerError(f"{rank.place.name} failed: {reply.error}"))
        return reply.value

    def _died(self, rank: _Rank) -> None:
        """Fail the executor for a rank whose process is gone (or closed its pipe)."""
        try:
            code = rank.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        how = "is still running but closed its pipe" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        self._fail(WorkerDiedError(f"worker process of {rank.place.name} (pid "
                                   f"{rank.process.pid}) {how}; the engine cannot continue"))

    def _fail(self, err: RuntimeError) -> None:
        """Record the failure, stop every rank and raise; later calls raise it again."""
        self._failure = err
        logger.error("%s", err)
        for rank in self._ranks:  # a stage without its peer can only wait: no graceful stop
            if rank.alive():
                rank.process.terminate()
        self.shutdown()
        raise err

    def _call_all(self, call: WorkerCall) -> list[Any]:
        """Run a call on every rank (after the steps in flight); their answers in rank order."""
        self._check_alive()
        self._steps.drain()
        for rank in self._ranks:
            self._send(rank, call)
        return self._gather()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))

    # ---- Executor -----------------------------------------------------------
    def kv_block_bytes(self) -> int:
        # the largest stage's block: the engine divides the memory answer by it
        return max(self._call_all(WorkerCall("kv_block_bytes")))

    def determine_available_memory(self) -> int:
        available = self._call_all(WorkerCall("determine_available_memory"))
        block_bytes = self._call_all(WorkerCall("kv_block_bytes"))
        # every stage holds the same block ids: the fewest blocks any stage can hold
        num_blocks = min(a // b for a, b in zip(available, block_bytes))
        return num_blocks * max(block_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all(WorkerCall("initialize_kv_cache", (num_blocks,)))

    @property
    def max_concurrent_batches(self) -> int:
        # one step per pipeline stage; tensor parallel ranks all run every step together
        return self.config.parallel.pipeline_parallel_size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def execute_model_async(self, sched: SchedulerOutput) -> PendingStep:
        self._check_alive()
        deadline_s = self._deadlines.next(sched.num_scheduled_tokens)
        payload = pickle.dumps(WorkerCall("execute_model", (sched,)),
                               protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > BIG_CALL_BYTES:
            self._steps.drain()
        for rank in self._ranks:
            self._send_bytes(rank, payload)
        # the replies are read from the pipes, in order; the handle: how long they may take
        return self._steps.submit(deadline_s)

    def _take_oldest(self, deadline_s: Optional[float]) -> ModelRunnerOutput:
        """The driver's reply to the oldest step in flight; a rank that died, or did not
        answer within the step's deadline, fails the executor (and so every step in flight)."""
        self._check_alive()
        return self._gather(deadline_s)[self._driver]

    def decode_path(self) -> str:
        return self._decode_paths[self._driver]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._call_all(WorkerCall(method, args))

    def shutdown(self) -> None:
        """Stop every rank's process and remove the process group's store."""
        self._finalizer()

    @property
    def watches_ranks(self) -> bool:
        return self._deadlines.enabled

    @property
    def worker_pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return [r.process.pid for r in self._ranks]
