#!/usr/bin/env bash
# Idempotent setup: .venv, torch (CPU build when no NVIDIA GPU), pagedllm[test], known models.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { echo "[setup] $*" >&2; }
trap 'echo "[setup] FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.pagedllm-install-stamp"
TORCH_CPU_PIN="torch==2.13.0"

quiet() {  # run a command silently; on failure show its full output and fail
  local out rc=0
  out="$(mktemp)"
  "$@" >"$out" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[setup] error: '$*' failed (exit $rc); its output:" >&2
    cat "$out" >&2
  fi
  rm -f "$out"
  return "$rc"
}

require_py310() {  # $1: interpreter; fail with a clear message unless it is Python >= 3.10
  if ! "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    echo "[setup] error: pagedllm needs Python >= 3.10; '$1' is $("$1" --version 2>&1 || echo missing)" >&2
    exit 1
  fi
}

if [ ! -x "$PY" ]; then
  command -v python3 >/dev/null || { echo "[setup] error: python3 not found on PATH" >&2; exit 1; }
  require_py310 python3
  log "creating $VENV with $(python3 --version 2>&1)"
  quiet python3 -m venv "$VENV"
fi
require_py310 "$PY"

if nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; else has_gpu=0; fi
want_stamp="$("$PY" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())') gpu=$has_gpu root=$PWD"

if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want_stamp" ] \
   || ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("pagedllm") is None)'; then
  if [ "$has_gpu" = 0 ]; then
    # A plain `torch` requirement would pull the large CUDA build; pin the CPU one first.
    log "no NVIDIA GPU (nvidia-smi -L failed): installing $TORCH_CPU_PIN (CPU build)"
    quiet "$PY" -m pip install -q --disable-pip-version-check "$TORCH_CPU_PIN"
  fi
  log "installing pagedllm (editable) with test extras"
  quiet "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want_stamp" > "$STAMP"
else
  log "pagedllm already installed for this pyproject.toml"
fi

log "building the CPU kernels (cached per machine; about a minute the first time)"
"$PY" -m pagedllm.kernels >&2 || log "warning: the CPU kernels did not build; GGUF models will be dequantized at load (slower, larger)"

log "fetching known models into the cache"
"$PY" -m pagedllm.loader.model_store --all >&2
log "done"
