#!/usr/bin/env bash
# Set up, then run the Qwen offline example on the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/qwen_offline.py "$@"
