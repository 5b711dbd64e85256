#!/usr/bin/env bash
# Idempotent setup: .venv, torch (CPU build when no NVIDIA GPU), pagedllm[test,ray], known models.
#
# Without an NVIDIA GPU, torch comes from PyTorch's CPU wheel index ($PAGEDLLM_TORCH_INDEX_URL,
# default https://download.pytorch.org/whl/cpu), or from pip's default index when that one does
# not answer; the log says which. The functions come first and main runs only when the script is
# executed, so tests/test_setup_script.py can source it and run one of them.

TORCH_CPU_PIN="torch==2.13.0"
TORCH_CPU_INDEX="${PAGEDLLM_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
PROBE_TIMEOUT_S=5
VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.pagedllm-install-stamp"
# Extras to install: none to serve (quickstart.sh); scripts/test.sh asks for "test,ray" (ray: the
# tests run the Ray executor on a local two-node cluster). Installed extras are kept, so a later
# run that asks for fewer installs nothing.
EXTRAS="${PAGEDLLM_SETUP_EXTRAS:-}"
# Models to fetch: the default one to serve; --all (every shipped model) for the tests.
MODELS="${PAGEDLLM_SETUP_MODELS:-}"

log() { echo "[setup] $*" >&2; }

extras_covered() {  # $1: extras wanted, $2: extras installed (comma lists); true if $1 within $2
  local want
  for want in ${1//,/ }; do
    case ",$2," in *",$want,"*) ;; *) return 1 ;; esac
  done
}

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

pip_install() {  # pip install ARGS... into the venv, quietly
  quiet "$PY" -m pip install -q --disable-pip-version-check "$@"
}

require_py310() {  # $1: interpreter; fail with a clear message unless it is Python >= 3.10
  if ! "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    echo "[setup] error: pagedllm needs Python >= 3.10; '$1' is $("$1" --version 2>&1 || echo missing)" >&2
    exit 1
  fi
}

index_reachable() {  # $1: a package index URL; true when it answers within PROBE_TIMEOUT_S
  "$PY" - "$1" "$PROBE_TIMEOUT_S" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=float(sys.argv[2])).close()
EOF
}

install_cpu_torch() {  # torch's CPU build: from PyTorch's CPU index, else from pip's default
  if index_reachable "$TORCH_CPU_INDEX"; then
    log "installing $TORCH_CPU_PIN (CPU build) from $TORCH_CPU_INDEX"
    if pip_install --index-url "$TORCH_CPU_INDEX" "$TORCH_CPU_PIN"; then
      return 0
    fi
    log "installing from $TORCH_CPU_INDEX failed; trying pip's default index"
  else
    log "$TORCH_CPU_INDEX did not answer within ${PROBE_TIMEOUT_S} s"
  fi
  # on PyPI itself the Linux x86-64 wheel is the CUDA build (several GB): `pagedllm doctor`
  # warns when that happened and prints the command that swaps it
  log "installing $TORCH_CPU_PIN from pip's default index (a CPU build only where that index has one)"
  pip_install "$TORCH_CPU_PIN"
}

main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  trap 'echo "[setup] FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

  if [ ! -x "$PY" ]; then
    command -v python3 >/dev/null || { echo "[setup] error: python3 not found on PATH" >&2; exit 1; }
    require_py310 python3
    log "creating $VENV with $(python3 --version 2>&1)"
    quiet python3 -m venv "$VENV"
  fi
  require_py310 "$PY"

  local has_gpu want_stamp
  if nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; else has_gpu=0; fi
  want_stamp="$("$PY" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())') gpu=$has_gpu root=$PWD"
  local stamp have_extras
  stamp="$(head -n1 "$STAMP" 2>/dev/null || true)"
  have_extras="$(sed -n 2p "$STAMP" 2>/dev/null || true)"

  if [ "$stamp" != "$want_stamp" ] || ! extras_covered "$EXTRAS" "$have_extras" \
     || ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("pagedllm") is None)'; then
    if [ "$has_gpu" = 0 ]; then
      # A plain `torch` requirement would pull the large CUDA build; pin the CPU one first.
      log "no NVIDIA GPU (nvidia-smi -L failed)"
      install_cpu_torch
    fi
    if [ "$stamp" = "$want_stamp" ]; then  # same project: keep what is installed, add to it
      EXTRAS="$(echo "$have_extras,$EXTRAS" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
    fi
    log "installing pagedllm (editable) with the extras '${EXTRAS}'"
    pip_install -e ".${EXTRAS:+[$EXTRAS]}"
    printf '%s\n%s\n' "$want_stamp" "$EXTRAS" > "$STAMP"
  else
    log "pagedllm already installed for this pyproject.toml"
  fi

  log "building the CPU kernels (cached per machine; about a minute the first time)"
  "$PY" -m pagedllm.kernels >&2 || log "warning: the CPU kernels did not build; GGUF models will be dequantized at load (slower, larger)"

  if [ "$MODELS" = --all ]; then log "fetching every shipped model into the cache"
  else log "fetching ${MODELS:-the default model} into the cache"; fi
  "$PY" -m pagedllm.hub.model_store $MODELS >&2
  log "done"
}

if ! (return 0 2>/dev/null); then  # `return` works only in a sourced file: executed, run main
  main "$@"
fi
