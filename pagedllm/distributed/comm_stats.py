"""Timings of a tensor-parallel rank's collectives, read by the executor's comm_stats call
(with the pipeline's send/recv timings, worker/stage_comm.py) and reported per step by
`pagedllm bench -tp N`.

An all-reduce returns once every rank has given its part, so its time on a rank is the
transfer plus the wait for the slowest rank to reach it (uneven shares show up here)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass


class Counters:
    """A dataclass of counters that can be read, and started again, as a dict."""

    def snapshot(self, reset: bool = False) -> dict:
        """The counters as a dict; reset=True starts them again from zero."""
        out = asdict(self)
        if reset:
            self.__init__()
        return out


@dataclass
class CollectiveStats(Counters):
    """This rank's collectives since it started (or since the last reset)."""

    forwards: int = 0  # model steps: each runs one embedding all-reduce first
    all_reduces: int = 0
    all_reduce_s: float = 0.0
    all_reduce_bytes: int = 0
    all_gathers: int = 0
    all_gather_s: float = 0.0
    all_gather_bytes: int = 0  # this rank's part, sent to every other rank

    def add_all_reduce(self, nbytes: int, started: float) -> None:
        """Count an all-reduce of nbytes that began at perf_counter() `started`."""
        self.all_reduce_s += time.perf_counter() - started
        self.all_reduces += 1
        self.all_reduce_bytes += nbytes

    def add_all_gather(self, nbytes: int, started: float) -> None:
        """Count an all-gather of this rank's nbytes that began at perf_counter() `started`."""
        self.all_gather_s += time.perf_counter() - started
        self.all_gathers += 1
        self.all_gather_bytes += nbytes


TP_COMM_STATS = CollectiveStats()
