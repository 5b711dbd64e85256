"""Two pagedllm processes on one small machine: single-stream decode tok/s alone and with a
second process decoding at the same time, under OpenMP wait policies.

    python benchmarks/bench_sharing.py [--model M] [--policies default,spin0,passive]

Each policy runs `pagedllm bench latency` once alone and then twice at once (both timed), as
separate processes with the policy's environment. Prints one line per policy."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# environment of each policy; "default" is what pagedllm sets when the user sets nothing
POLICIES = {
    "default": {},  # pagedllm's own choice (GOMP_SPINCOUNT=1000, pagedllm/__init__.py)
    "gomp-spin-300k": {"GOMP_SPINCOUNT": "300000"},  # libgomp's own default
    "gomp-spin-30k": {"GOMP_SPINCOUNT": "30000"},
    "gomp-spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "gomp-spin-3k": {"GOMP_SPINCOUNT": "3000"},
    "gomp-spin-1k": {"GOMP_SPINCOUNT": "1000"},
    "gomp-spin-100": {"GOMP_SPINCOUNT": "100"},
    "gomp-spin-0": {"GOMP_SPINCOUNT": "0"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}


def _bench(model: str, env: dict[str, str], out: str, output_len: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "latency", "--model",
           model, "--input-len", "32", "--output-len", str(output_len), "--num-iters", "3",
           "--num-iters-warmup", "1", "--output-json", out]
    full = {k: v for k, v in os.environ.items()
            if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.Popen(cmd, env={**full, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _decode_tps(path: str) -> float:
    with open(path) as fh:
        data = json.load(fh)
    return float(data["decode_tok_per_s"])


def run(model: str, policy: str, output_len: int) -> tuple[float, list[float]]:
    """(decode tok/s alone, [tok/s of each of two at once])."""
    env = POLICIES[policy]
    with tempfile.TemporaryDirectory() as tmp:
        alone = os.path.join(tmp, "alone.json")
        if _bench(model, env, alone, output_len).wait() != 0:
            raise SystemExit(f"bench failed for policy {policy}")
        pair = [os.path.join(tmp, f"pair{i}.json") for i in range(2)]
        procs = [_bench(model, env, p, output_len) for p in pair]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit(f"bench failed for policy {policy} (pair)")
        return _decode_tps(alone), [_decode_tps(p) for p in pair]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    for policy in args.policies.split(","):
        alone, pair = run(args.model, policy, args.output_len)
        print(f"{policy:>16}: alone {alone:6.1f} tok/s | two at once "
              f"{pair[0]:6.1f} + {pair[1]:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
