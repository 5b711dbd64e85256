"""Each pytest-xdist worker of scripts/test.sh's first part gets its own share of the CPUs."""
from __future__ import annotations

import os

import pytest

from suite_parts import worker_cpus


@pytest.mark.parametrize("cpus, workers, shares", [
    (2, 2, [[0], [1]]),
    (4, 2, [[0, 1], [2, 3]]),
    (16, 3, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]),
    (7, 3, [[0, 1], [2, 3], [4, 5, 6]]),
    (2, 3, [[0], [1], [0]]),
    (1, 2, [[0], [0]]),
])
def test_each_worker_gets_its_share_of_the_cpus(cpus, workers, shares):
    assert [worker_cpus(list(range(cpus)), w, workers) for w in range(workers)] == shares


def test_this_process_keeps_to_its_share():
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("not in a pytest-xdist worker (scripts/test.sh's first part)")
    import torch

    mine = sorted(os.sched_getaffinity(0))
    assert torch.get_num_threads() == len(mine)
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    assert len(mine) <= -(-os.cpu_count() // workers)  # its share, rounded up
