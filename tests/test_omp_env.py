"""Importing pagedllm bounds OpenMP's spin-wait (two processes on 2 vCPUs do not collapse),
unless the user set the policy or torch was loaded first."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PRINT = "import os; {pre}import pagedllm; print(os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize("env, pre, expected", [
    ({}, "", "1000"),
    ({"GOMP_SPINCOUNT": "300000"}, "", "300000"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "", "None"),
    ({}, "import torch; ", "None"),  # too late: libgomp has read its settings already
])
def test_spin_count_default(env, pre, expected):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _PRINT.format(pre=pre)], env={**base, **env},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
