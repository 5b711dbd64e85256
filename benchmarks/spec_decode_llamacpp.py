"""llama.cpp's speculation on the workloads of `pagedllm bench latency --workload`: the same
prompts (token ids of the same GGUF's vocabulary), greedy, --output-len tokens each, through a
llama-server started here with `--spec-type ngram-simple`, a draft model (`-md`), or neither.

    .venv/bin/python benchmarks/spec_decode_llamacpp.py --llama-server PATH/llama-server \
        --workload code-edit [--spec-type ngram-simple | --draft-model DRAFT.gguf --draft-max 4]

Prints each timed request's decode tok/s (llama-server's predicted_per_second) and its draft
counts, then the mean; the first --num-iters-warmup requests are not timed, as in the bench.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import time

import httpx

from pagedllm.entrypoints.bench import WORKLOADS, workload_prompts
from pagedllm.hub.model_store import DEFAULT_MODEL
from pagedllm.tokenizer.tokenizer import load_tokenizer


def _gguf(model: str) -> str:
    from pathlib import Path

    import pagedllm

    return str(next(Path(pagedllm.model_path(model)).glob("*.gguf")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    """Start llama-server, send the workload's prompts one at a time, print the timings."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--workload", choices=WORKLOADS[1:], default="code-edit")
    ap.add_argument("--spec-type", default=None, help="e.g. ngram-simple (default: none)")
    ap.add_argument("--draft-model", default=None, help="a draft GGUF (llama-server -md)")
    ap.add_argument("--draft-max", type=int, default=None,
                    help="drafts a step (llama-server --spec-draft-n-max; its default: 3)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-iters", type=int, default=2)
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    args = ap.parse_args()
    # the prompts' token ids, from pagedllm's tokenizer of the same GGUF
    prompts = workload_prompts(load_tokenizer(_gguf(args.model)), args.workload,
                               args.num_iters_warmup + args.num_iters, 0)
    port = _free_port()
    cmd = [args.llama_server, "-m", _gguf(args.model), "-t", "2", "-c", "8192", "--port",
           str(port), "-np", "1"] + (["--spec-type", args.spec_type] if args.spec_type else [])
    if args.draft_model:
        cmd += ["-md", args.draft_model, "-td", "2"]
        if not args.spec_type:
            cmd += ["--spec-type", "draft-simple"]
    if args.draft_max:
        cmd += ["--spec-draft-n-max", str(args.draft_max)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(port)
        rates = []
        for i, prompt in enumerate(prompts):
            body = {"prompt": prompt["prompt_token_ids"], "n_predict": args.output_len,
                    "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            t = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600).json()
            timing = t["timings"]
            if i >= args.num_iters_warmup:
                rates.append(timing["predicted_per_second"])
            print(f"request {i}: prompt {timing['prompt_n']} tokens, decode "
                  f"{timing['predicted_per_second']:.2f} tok/s, drafts "
                  f"{timing.get('draft_n', 0)} accepted {timing.get('draft_n_accepted', 0)}")
        print(f"mean decode tok/s over the timed requests: {statistics.mean(rates):.2f}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait_healthy(port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become healthy in 120 s")


if __name__ == "__main__":
    main()
