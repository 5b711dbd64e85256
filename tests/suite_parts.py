"""How scripts/test.sh's first part shares the CPUs among its pytest-xdist workers."""
from __future__ import annotations


def worker_cpus(cpus: list[int], worker: int, workers: int) -> list[int]:
    """The CPUs of pytest-xdist worker `worker` of `workers`: an equal share of `cpus` each
    (the last shares take the remainder one by one), or one CPU, shared round-robin, where there
    are more workers than CPUs."""
    if workers >= len(cpus):
        return [cpus[worker % len(cpus)]]
    share, extra = divmod(len(cpus), workers)
    start = worker * share + max(0, worker - (workers - extra))
    return cpus[start:start + share + (worker >= workers - extra)]
