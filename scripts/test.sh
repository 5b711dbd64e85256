#!/usr/bin/env bash
# Set up, then run the test suite; extra arguments go to pytest (to both parts).
#
# Two parts (tests/conftest.py says which tests are `alone` and why): all but the alone tests
# first, in PAGEDLLM_TEST_WORKERS pytest-xdist workers (default 2; whole files per worker, each
# worker on its own share of the CPUs), then the alone tests one at a time. Both parts run; the
# script fails if either fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PAGEDLLM_SETUP_EXTRAS=test,ray PAGEDLLM_SETUP_MODELS=--all bash scripts/setup.sh

part() {  # pytest's exit status, with 5 (this part selected no test) read as success
    local rc=0
    .venv/bin/python -m pytest -q --durations=25 "$@" || rc=$?
    [ "$rc" -eq 5 ] && rc=0
    return "$rc"
}

rc=0
part -n "${PAGEDLLM_TEST_WORKERS:-2}" --dist loadfile -m "not alone" tests "$@" || rc=$?
part -m alone tests "$@" || rc=$?
exit "$rc"
