#!/usr/bin/env bash
# Set up, then serve the default model over the OpenAI-compatible API on 127.0.0.1:8000.
# Extra arguments go to `pagedllm serve` (e.g. --port 9000, --api-key KEY, another model).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/pagedllm serve "$@"
