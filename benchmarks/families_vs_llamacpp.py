"""One-stream decode of the families with no shipped weights, beside llama.cpp on the same GGUF.

    .venv/bin/python benchmarks/families_vs_llamacpp.py --llama-cpp DIR [--families qwen3_moe phi3]
        [--pairs 3] [--quant Q4_K_M] [--work /tmp/pagedllm-families]

DIR is llama.cpp's source tree with its build (the llama-cpp-python sdist's vendor/llama.cpp,
built with -DGGML_NATIVE=ON): its `convert_hf_to_gguf.py` and `build/bin/llama-quantize` make
the GGUF, its `build/bin/llama-bench` times it. For each family a model of the default model's
size class (hidden 896, 24 layers, the default model's tokenizer and vocabulary) is built with
transformers' own class and random weights (decode speed does not depend on the values; both
engines run the same file), saved as an HF directory in bfloat16, converted to an f16 GGUF by
llama.cpp's converter and quantized by llama-quantize. Then, alternating, `pagedllm bench
latency --input-len 16 --output-len 128` and `llama-bench -p 0 -n 128 -t 2`, --pairs times.
llama.cpp's converter imports `sentencepiece` on SmolLM3's tokenizer path (pip install it into
the environment that runs this script; pagedllm itself does not need it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# the default model's (Qwen2.5-0.5B) size class for each family, its own layer kinds kept
COMMON = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, max_position_embeddings=4096,
              rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_model(family: str, vocab: int) -> torch.nn.Module:
    """transformers' own model of the family, random weights (normal, std 0.02)."""
    import transformers as tf
    if family == "qwen3_moe":  # routed experts: 32 of 256 wide, 4 chosen (Qwen3-30B-A3B's shape, scaled)
        cfg = tf.Qwen3MoeConfig(vocab_size=vocab, intermediate_size=4864, moe_intermediate_size=256,
                                num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                                num_key_value_heads=2, head_dim=64, **COMMON)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # Qwen1.5-MoE's kinds (it chooses 4 of 60): routed experts and a gated shared expert
        cfg = tf.Qwen2MoeConfig(vocab_size=vocab, intermediate_size=4864, moe_intermediate_size=256,
                                shared_expert_intermediate_size=1024, num_experts=32, num_experts_per_tok=4,
                                num_key_value_heads=2, **{**COMMON, "tie_word_embeddings": False})
        cls = tf.Qwen2MoeForCausalLM  # (llama.cpp's qwen2moe needs an output.weight of its own)
    elif family == "phi3":  # Phi-4-mini's kinds: partial rotary (0.75), fused qkv and gate_up
        cfg = tf.Phi3Config(vocab_size=vocab, intermediate_size=4864, num_key_value_heads=2,
                            partial_rotary_factor=0.75, pad_token_id=0, **COMMON)
        cls = tf.Phi3ForCausalLM
    elif family == "smollm3":  # every 4th layer without RoPE
        cfg = tf.SmolLM3Config(vocab_size=vocab, intermediate_size=4864, num_key_value_heads=2,
                               no_rope_layer_interval=4, pad_token_id=0, **COMMON)
        cls = tf.SmolLM3ForCausalLM
    elif family == "qwen3":  # per-head q/k norms
        cfg = tf.Qwen3Config(vocab_size=vocab, intermediate_size=4864, num_key_value_heads=2, head_dim=64,
                             **COMMON)
        cls = tf.Qwen3ForCausalLM
    else:
        raise SystemExit(f"--families: unknown family {family!r}")
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.to(torch.bfloat16).eval()


def make_gguf(family: str, work: Path, llama_cpp: Path, tokenizer_dir: Path, quant: str) -> Path:
    """The family's GGUF at quant, built once under work."""
    out = work / f"{family}-{quant.lower()}.gguf"
    if out.exists():
        return out
    hf = work / f"{family}-hf"
    vocab = int(re.search(r'"vocab_size":\s*(\d+)', (tokenizer_dir / "config.json").read_text()).group(1))
    build_model(family, vocab).save_pretrained(hf, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, hf / name)
    if family == "phi3":  # the converter's Phi-4 branch takes a BPE tokenizer (it names GPT2Tokenizer)
        cfg = json.loads((hf / "tokenizer_config.json").read_text())
        (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    f16 = work / f"{family}-f16.gguf"
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                    "--outfile", str(f16)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    env = dict(os.environ, LD_LIBRARY_PATH=str(llama_cpp / "build" / "bin"))
    subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(out), quant], check=True,
                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    f16.unlink()
    shutil.rmtree(hf)
    return out


def pagedllm_decode(gguf: Path) -> float:
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "latency", "--model", str(gguf),
                          "--input-len", "16", "--output-len", "128", "--num-iters", "2"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return float(re.search(r"decode_tok_per_s\s+([\d.]+)", out).group(1))


def llamacpp_decode(gguf: Path, llama_cpp: Path) -> float:
    env = dict(os.environ, LD_LIBRARY_PATH=str(llama_cpp / "build" / "bin"))
    out = subprocess.run([str(llama_cpp / "build" / "bin" / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "128",
                          "-t", "2", "-r", "3"], capture_output=True, text=True, check=True, env=env).stdout
    line = next(ln for ln in out.splitlines() if "tg128" in ln)
    return float(re.search(r"\|\s*([\d.]+)\s*±", line).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree with build/bin")
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "qwen2_moe", "phi3", "smollm3", "qwen3"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pagedllm-families"))
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="an HF directory whose tokenizer files and vocab_size to use (default: the "
                         "default model's HF export, built by the model store)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tok = args.tokenizer_dir
    if tok is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_hf_dir  # the suite's export of the default model (cached)

        tok = build_hf_dir("qwen2.5-coder-0.5b-instruct")
    for family in args.families:
        gguf = make_gguf(family, args.work, args.llama_cpp, tok, args.quant)
        print(f"== {family} ({gguf.stat().st_size / 1e6:.0f} MB {args.quant})", flush=True)
        for i in range(args.pairs):
            load = os.getloadavg()[0]
            ours = pagedllm_decode(gguf)
            theirs = llamacpp_decode(gguf, args.llama_cpp)
            print(f"pair {i + 1} {time.strftime('%H:%M:%S')} load {load:.2f}: pagedllm {ours:.1f} tok/s, "
                  f"llama.cpp tg128 {theirs:.1f} ({ours / theirs:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
