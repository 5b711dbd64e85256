"""Shared helpers for end-to-end tests: prompts and direct logits from a loaded engine."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedllm.attention.metadata import set_forward_context
from pagedllm.layers.attention import bind_kv_cache
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBuffers, build_step_inputs
from pagedllm.worker.kv_cache import allocate_kv_cache
from pagedllm.worker.model_runner import ModelRunner

# Raw text, code, Chinese and chat-templated prompts. Each keeps a top-1/top-2 logit margin of at
# least ~0.2 over its first 8 greedy tokens on both models, so a bfloat16 run can be held to the
# same tokens; at a near-tie (margins of 0.02-0.1 are common for these small models) bf16
# rounding legitimately picks the other token, for HF transformers as for pagedllm.
RAW_PROMPTS = [
    "The largest planet in the solar system is",
    "# Compute the factorial of n\ndef factorial(n):",
    "def fibonacci(n):",
    "Translate to English: 你好，世界",
]
CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "user", "content": "用中文回答：一年有几个月？"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
]


def parity_prompts(tokenizer) -> list[str]:
    """Raw text, code, Chinese and chat-templated prompts."""
    chats = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in CHAT_CONVERSATIONS]
    return RAW_PROMPTS + chats


def model_runner(llm) -> ModelRunner:
    """The model runner of an offline LLM's in-process worker."""
    return llm.llm_engine.engine_core.executor.model_runner


@torch.no_grad()
def last_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits [V] after a prompt, from the engine's model over a scratch paged cache."""
    runner = model_runner(llm)
    model = runner.model
    cfg = model.config
    bs = 16
    nblocks = -(-len(token_ids) // bs)
    kv = allocate_kv_cache(cfg.num_hidden_layers, nblocks + 1, bs, cfg.num_key_value_heads,
                           cfg.head_dim, llm.llm_engine.config.dtype, torch.device("cpu"))
    # blocks in reverse order, so the test also exercises a non-trivial block table
    state = CachedRequestState("x", list(token_ids), len(token_ids), SamplingParams(), None,
                               list(range(nblocks, 0, -1)), 0)
    buffers = InputBuffers(len(token_ids), 1, nblocks, torch.device("cpu"))
    step = build_step_inputs([state], [len(token_ids)], bs, buffers)
    bind_kv_cache(model, kv)
    try:
        with set_forward_context(runner.attn_builder.build(step.attn)):
            hidden = model(step.input_ids, step.positions)
    finally:
        bind_kv_cache(model, runner.kv_cache)
    return model.compute_logits(hidden[-1:])[0].float()


def save_bf16_export(src: Path, out: Path) -> Path:
    """A copy of the HF checkpoint dir src in out with its tensors rounded to bf16 and its
    config's dtype bf16 (what a bf16 checkpoint on the Hub looks like)."""
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()},
                      str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    return out
