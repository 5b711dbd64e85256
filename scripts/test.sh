#!/usr/bin/env bash
# Set up, then run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PAGEDLLM_SETUP_EXTRAS=test,ray PAGEDLLM_SETUP_MODELS=--all bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 tests "$@"
