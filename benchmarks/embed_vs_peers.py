"""Embeddings per second of one engine on the same N sentences of ~20-60 tokens, 2 threads:
pagedllm's LLM.embed, sentence-transformers' encode, or a llama.cpp embedding server.

    .venv/bin/python benchmarks/embed_vs_peers.py pagedllm auto        # or float32: the dtype
    MINILM_DIR=DIR ST_PY benchmarks/embed_vs_peers.py st
        # ST_PY: a venv with sentence-transformers;
        # DIR: python -c "import pagedllm; print(pagedllm.model_path('all-minilm-l6-v2'))"
    .venv/bin/python benchmarks/embed_vs_peers.py llama http://127.0.0.1:8091
        # llama-server -m minilm-f32.gguf --embedding -t 2 -tb 2 -np 8 -c 4096 -ub 2048 --port 8091

The sentences are random words of all-MiniLM's vocabulary (seeded: every engine gets the same
512, N=... to change), so the shipped all-minilm-l6-v2 must be in the model store. One JSON line
per run: seconds, embeddings per second, the load average. Alternate the engines in pairs.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

N = int(os.environ.get("N", "512"))


def _model_dir() -> str:
    from pagedllm import model_path

    return str(model_path("all-minilm-l6-v2"))


def sentences(vocab_file: str, n: int = N, seed: int = 0) -> list[str]:
    words = [w for w in open(vocab_file).read().split("\n")
             if w.isalpha() and w.islower() and len(w) >= 3]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(16, 50))).capitalize() + "."
            for _ in range(n)]


def _runner(kind: str, arg: str | None, model_dir: str):
    if kind == "pagedllm":
        from pagedllm import LLM

        llm = LLM("all-minilm-l6-v2", device="cpu", dtype=arg or "auto")
        return lambda t: [o.outputs.embedding for o in llm.embed(t, use_tqdm=False)]
    if kind == "st":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(model_dir, device="cpu")
        return lambda t: model.encode(t, batch_size=32)
    if kind == "llama":
        import httpx

        def run(t):
            out = []
            for i in range(0, len(t), 64):
                r = httpx.post(f"{arg}/v1/embeddings", json={"input": t[i:i + 64]}, timeout=600)
                r.raise_for_status()
                out += [d["embedding"] for d in r.json()["data"]]
            return out
        return run
    raise SystemExit(f"engine must be pagedllm, st or llama, got {kind!r}")


def main() -> None:
    kind, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    import torch

    torch.set_num_threads(2)
    model_dir = os.environ.get("MINILM_DIR") or _model_dir()
    texts = sentences(os.path.join(model_dir, "vocab.txt"))
    run = _runner(kind, arg, model_dir)
    run(texts[:16])  # warm-up
    t0 = time.perf_counter()
    vecs = run(texts)
    dt = time.perf_counter() - t0
    assert len(vecs) == len(texts)
    print(json.dumps({"engine": kind, "arg": arg, "n": len(texts), "seconds": round(dt, 2),
                      "per_s": round(len(texts) / dt, 1), "load": os.getloadavg()[:3]}))


if __name__ == "__main__":
    main()
