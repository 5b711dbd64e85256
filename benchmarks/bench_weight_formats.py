"""The weight formats of an HF (float) checkpoint side by side: fp32, bf16, bf16x8 (bf16 matrices
for pagedllm's own kernels), int8 (Q8_0), int4 (Q4_1).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_weight_formats.py [--model DIR]
        [--formats fp32 bf16 int8 int4] [--repeats 2] [--skip-throughput] [--output-json PATH]

--model defaults to the test suite's HF export of the default model (tests/conftest.py's
build_hf_dir: the Q4_K_M GGUF dequantized to a float32 safetensors directory, built once into
~/.cache/pagedllm-tests). Per format, each in a fresh process so that peak RSS is its own:
  - perplexity on the shipped text (pagedllm/eval/perplexity.py) and the resident weights
    (the loaded model's parameter and buffer bytes, a tied embedding counted once);
  - `pagedllm bench latency --input-len 100 --output-len 128`: one-stream decode tok/s;
  - `pagedllm bench throughput --num-prompts 32 --input-len 100 --output-len 128`.
Timed runs are repeated --repeats times and the best kept (the machine may be shared). The
perplexities feed pagedllm/layers/weight_formats.py's table; rerun after kernel changes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# format name -> (dtype, quantization) as LLM() takes them
FORMATS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"),
           "bf16x8": ("auto", "bf16"), "int8": ("auto", "int8"), "int4": ("auto", "int4")}

_PPL_SNIPPET = """
import json, resource, sys
from pagedllm import LLM
from pagedllm.eval.perplexity import perplexity
model, dtype, quant = sys.argv[1:4]
llm = LLM(model=model, dtype=dtype, quantization=quant, max_model_len=4096)
net = llm.llm_engine.engine_core.executor.worker.model_runner.model
seen, weights = set(), 0
for t in list(net.parameters()) + list(net.buffers()):
    key = t.untyped_storage().data_ptr()
    if key not in seen:
        seen.add(key)
        weights += t.untyped_storage().nbytes()
ppl = perplexity(llm)
print(json.dumps({"perplexity": ppl, "weight_bytes": weights,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _bench(model: str, dtype: str, quant: str, mode: str, extra: list[str]) -> dict[str, Any]:
    """One `pagedllm bench` run in its own process; its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", mode, "--model", model,
               "--dtype", dtype, "--quantization", quant, "--output-json", out.name, *extra]
        subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def measure(model: str, fmt: str, repeats: int, throughput: bool) -> dict[str, Any]:
    """Perplexity, resident weights, peak RSS, decode and offline tok/s of one format."""
    dtype, quant = FORMATS[fmt]
    run = subprocess.run([sys.executable, "-c", _PPL_SNIPPET, model, dtype, quant], check=True,
                         env=_env(), capture_output=True, text=True)
    row: dict[str, Any] = {"format": fmt, **json.loads(run.stdout.strip().splitlines()[-1])}
    latency = [_bench(model, dtype, quant, "latency",
                      ["--input-len", "100", "--output-len", "128", "--num-iters", "2"])
               for _ in range(repeats)]
    row["decode_tok_per_s"] = max(r["decode_tok_per_s"] for r in latency)
    row["latency_peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in latency)
    if throughput:
        offline = [_bench(model, dtype, quant, "throughput",
                          ["--num-prompts", "32", "--input-len", "100", "--output-len", "128"])
                   for _ in range(repeats)]
        row["offline_output_tok_per_s"] = max(r["output_tok_per_s"] for r in offline)
        row["offline_peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in offline)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as docs/performance.md's table."""
    lines = ["| format | perplexity | weights | peak RSS | 1-stream decode tok/s | "
             "32 x (100+128) output tok/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        rss = max(r["peak_rss_bytes"], r["latency_peak_rss_bytes"],
                  r.get("offline_peak_rss_bytes", 0))
        offline = f"{r['offline_output_tok_per_s']:.1f}" if "offline_output_tok_per_s" in r else ""
        lines.append(f"| {r['format']} | {r['perplexity']:.3f} | {r['weight_bytes'] / 2**20:.0f} MiB"
                     f" | {rss / 2**20:.0f} MiB | {r['decode_tok_per_s']:.1f} | {offline} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF checkpoint directory (default: the "
                    "suite's export of the default model)")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per format (best kept)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_hf_dir  # the suite's export, reused (cached after the first)

        model = str(build_hf_dir("qwen2.5-coder-0.5b-instruct"))
    rows = []
    for fmt in args.formats:
        rows.append(measure(model, fmt, args.repeats, not args.skip_throughput))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
