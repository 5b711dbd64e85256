#!/usr/bin/env bash
# Gemma 3 270M Q4_K_M one-stream decode, pagedllm then llama.cpp on the same GGUF, alternating
# (3 pairs by default). LLAMA_BENCH: llama.cpp's llama-bench (built from the llama-cpp-python
# sdist's vendor/llama.cpp with -DGGML_NATIVE=ON). Run from the repository root.
set -euo pipefail
LLAMA_BENCH="${LLAMA_BENCH:?set LLAMA_BENCH to the llama-bench of llama.cpp}"
PAIRS="${PAIRS:-3}"
MODEL_DIR="$(.venv/bin/python -c "import pagedllm; print(pagedllm.model_path('gemma-3-270m'))")"
GGUF="$MODEL_DIR/gemma-3-270m-q4_k_m.gguf"
for i in $(seq "$PAIRS"); do
  echo "== pair $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/python -m pagedllm.entrypoints.cli bench latency --model gemma-3-270m \
    --input-len 16 --output-len 128 --num-iters 2 2>/dev/null | grep -E 'decode_tok_per_s'
  "$LLAMA_BENCH" -m "$GGUF" -p 0 -n 128 -t 2 -r 3 2>/dev/null | grep tg128
done
