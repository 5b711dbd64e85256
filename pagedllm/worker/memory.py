"""Memory planning as pure functions: what the model needs, what fits, and what to do if nothing does.

Everything here runs on metadata before a weight byte is read or downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.config import ModelArchConfig
from pagedllm.platforms.interface import GiB, MemoryInfo, fmt_bytes

RUNTIME_OVERHEAD_BYTES = 384 * 1024 ** 2  # tokenizer, Python objects, allocator slack still to come
MEMORY_UTILIZATION = 0.92  # share of available memory the engine plans to use
DEFAULT_KV_CAP_BYTES = 1 * GiB  # the KV cache takes no more than this unless asked
MIN_MODEL_LEN = 2048  # a default max_model_len is shrunk to fit, but not below this
# the advice offers a GGUF with its blocks mapped from a file when the page cache would hold at
# least this share of them (below, each token re-reads too much from disk)
MAPPED_MIN_SHARE = 0.75

# Known sizes per family, for the "a smaller model of the same family" advice: (name, parameters)
FAMILY_SIZES = {
    "qwen2": [("Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen2.5-1.5B-Instruct", 1.54e9),
              ("Qwen2.5-3B-Instruct", 3.09e9), ("Qwen2.5-7B-Instruct", 7.62e9)],
    "qwen3": [("Qwen3-0.6B", 0.75e9), ("Qwen3-1.7B", 2.03e9), ("Qwen3-4B", 4.02e9),
              ("Qwen3-8B", 8.19e9)],
    "llama": [("SmolLM2-135M-Instruct", 0.135e9), ("SmolLM2-360M-Instruct", 0.36e9),
              ("Llama-3.2-1B-Instruct", 1.24e9), ("SmolLM2-1.7B-Instruct", 1.71e9),
              ("Llama-3.2-3B-Instruct", 3.21e9), ("Llama-3.1-8B-Instruct", 8.03e9)],
}


class InsufficientMemoryError(ValueError):
    """The model cannot run in the memory available; the message says what would."""


@dataclass(frozen=True)
class ModelFootprint:
    """What a model needs, from metadata: parameters, bytes per weight, KV bytes per token."""

    arch: ModelArchConfig
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    dtype_name: str
    source: str  # where the parameter count came from
    mapped_bytes: int = 0  # block weights mapped from a file (page cache), not in weight_bytes

    @property
    def max_len_supported(self) -> int:
        """Positions the model was trained for (a sliding window does not cut them: its layers
        attend over the window, and the cache still holds the whole sequence)."""
        return self.arch.max_position_embeddings


@dataclass(frozen=True)
class MemoryPlan:
    """The sizes chosen for this engine, and the numbers behind them."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    weight_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    overhead_bytes: int
    available: MemoryInfo
    mapped_bytes: int = 0  # block weights mapped from a file: they live in the page cache

    def page_cache_room(self) -> int:
        """Bytes of the planned memory left for the page cache to hold mapped weights."""
        used = self.weight_bytes + self.kv_cache_bytes + self.activation_bytes + self.overhead_bytes
        return max(0, int(self.available.available_bytes * MEMORY_UTILIZATION) - used)

    def mapped_note(self) -> str:
        """What the mapped weights cost, or "" when none are mapped."""
        if not self.mapped_bytes:
            return ""
        room = self.page_cache_room()
        if room >= self.mapped_bytes:
            return (f"; GGUF blocks {fmt_bytes(self.mapped_bytes)} mapped from a file, and the "
                    f"page cache has room for all of them ({fmt_bytes(room)} left)")
        return (f"; GGUF blocks {fmt_bytes(self.mapped_bytes)} mapped from a file, of which the "
                f"page cache can hold ~{fmt_bytes(room)}: each decode step re-reads up to "
                f"~{fmt_bytes(self.mapped_bytes - room)} from disk")

    def summary(self) -> str:
        """One log line."""
        return (f"memory plan: weights {fmt_bytes(self.weight_bytes)}{self.mapped_note()}, KV cache "
                f"{fmt_bytes(self.kv_cache_bytes)} ({self.num_blocks} blocks of {self.block_size}"
                f" = {self.num_blocks * self.block_size} tokens), activations "
                f"{fmt_bytes(self.activation_bytes)}, runtime {fmt_bytes(self.overhead_bytes)}; "
                f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}; "
                "preemption recomputes (no swap space); "
                f"available {fmt_bytes(self.available.available_bytes)} ({self.available.source})")


def kv_bytes_per_token(arch: ModelArchConfig, itemsize: int) -> int:
    """K and V of one token across all layers."""
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize


def footprint(arch: ModelArchConfig, num_params: int, itemsize: int, dtype_name: str,
              source: str, weight_bytes: Optional[int] = None,
              mapped_bytes: int = 0) -> ModelFootprint:
    """A model's needs when its weights are held in a dtype of `itemsize` bytes (or take
    weight_bytes when some stay quantized, mapped_bytes of them from a file)."""
    resident = num_params * itemsize if weight_bytes is None else weight_bytes
    return ModelFootprint(arch, num_params, resident - mapped_bytes,
                          kv_bytes_per_token(arch, itemsize), dtype_name, source, mapped_bytes)


def activation_bytes(fp: ModelFootprint, max_num_batched_tokens: int, max_num_seqs: int,
                     kv_cache_bytes: int) -> int:
    """Peak workspace of one step: hidden activations, logits, one layer's gathered K/V."""
    a = fp.arch
    width = 4 * a.hidden_size + _ffn_width(a) + (
        a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    hidden = max_num_batched_tokens * width * 4
    logits = max_num_seqs * a.vocab_size * 4 * 4  # logits, float32 copy, softmax, filtered
    gathered = kv_cache_bytes // max(1, a.num_hidden_layers)  # decode reads one layer's context
    return hidden + logits + gathered


def _ffn_width(a: ModelArchConfig) -> int:
    """Float32 values per token of the widest feed-forward step: SwiGLU's gate, up and product;
    on a sparse layer, each of the k chosen experts' gathered input, gate/up, product and
    output, the shared expert's SwiGLU and the router's logits."""
    dense = 3 * a.intermediate_size
    moe = a.moe
    if moe is None:
        return dense
    shared = moe.shared_expert_intermediate_size or 0
    sparse = (moe.num_experts_per_tok * (2 * a.hidden_size + 3 * moe.moe_intermediate_size)
              + 3 * shared + moe.num_experts)
    return max(sparse, dense if moe.dense_layers else 0)


def plan_memory(fp: ModelFootprint, mem: MemoryInfo, *, block_size: int,
                max_model_len: Optional[int], max_num_seqs: int, max_num_batched_tokens: int,
                kv_cache_bytes: Optional[int] = None, num_blocks: Optional[int] = None,
                overhead_bytes: int = RUNTIME_OVERHEAD_BYTES) -> MemoryPlan:
    """Choose KV blocks and max_model_len that fit; explicit values win if they fit, else explain."""
    if max_model_len is not None and max_model_len > fp.max_len_supported:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model supports "
                         f"({fp.max_len_supported} positions)")
    block_bytes = fp.kv_bytes_per_token * block_size
    budget = int(mem.available_bytes * MEMORY_UTILIZATION)
    base_act = activation_bytes(fp, max_num_batched_tokens, max_num_seqs, 0)
    # decode gathers one layer's context: 1/num_layers of the cache on top of the cache itself
    kv_share = 1 + 1 / max(1, fp.arch.num_hidden_layers)
    free_for_kv = max(0, int((budget - fp.weight_bytes - overhead_bytes - base_act) / kv_share))
    want_len = max_model_len or fp.max_len_supported
    explicit_cache = num_blocks is not None or kv_cache_bytes is not None
    if num_blocks is None:
        one_seq = want_len * fp.kv_bytes_per_token  # the cap never cuts one full-length sequence
        default = min(free_for_kv, max(DEFAULT_KV_CAP_BYTES, one_seq), one_seq * max_num_seqs)
        if fp.mapped_bytes:  # leave the page cache room for the mapped weights first
            short = (max_model_len or min(MIN_MODEL_LEN, want_len)) * fp.kv_bytes_per_token
            default = min(default, free_for_kv, max(short, free_for_kv - fp.mapped_bytes))
        num_blocks = (kv_cache_bytes if kv_cache_bytes is not None else default) // block_bytes
    cache_tokens = num_blocks * block_size
    min_len = max_model_len or (1 if explicit_cache else min(MIN_MODEL_LEN, want_len))
    if num_blocks * block_bytes > free_for_kv or (not explicit_cache and cache_tokens < min_len):
        raise InsufficientMemoryError(_advice(fp, mem, budget, overhead_bytes, base_act,
                                              min_len if not explicit_cache else max(1, cache_tokens),
                                              block_size))
    if cache_tokens < min_len:
        raise ValueError(f"max_model_len={min_len} does not fit the KV cache ({num_blocks} blocks "
                         f"of {block_size} = {cache_tokens} tokens); lower max_model_len or "
                         "raise kv_cache_memory_bytes")
    kv_bytes = num_blocks * block_bytes
    return MemoryPlan(num_blocks, block_size, min(want_len, cache_tokens), max_num_seqs,
                      fp.weight_bytes, kv_bytes,
                      activation_bytes(fp, max_num_batched_tokens, max_num_seqs, kv_bytes),
                      overhead_bytes, mem, fp.mapped_bytes)


def _advice(fp: ModelFootprint, mem: MemoryInfo, budget: int, overhead: int, act: int,
            min_len: int, block_size: int) -> str:
    one_seq = fp.kv_bytes_per_token * min_len
    need = fp.weight_bytes + one_seq + overhead + act
    lines = [
        f"the model does not fit in memory: it needs {fmt_bytes(need)} = weights "
        f"{fmt_bytes(fp.weight_bytes)} ({fp.num_params / 1e9:.2f} B parameters in "
        f"{fp.dtype_name}; {fp.source}) + KV cache {fmt_bytes(one_seq)} for one sequence of "
        f"{min_len} tokens + activations {fmt_bytes(act)} + runtime {fmt_bytes(overhead)}",
        f"available: {fmt_bytes(mem.available_bytes)} ({mem.source}); the engine plans with "
        f"{MEMORY_UTILIZATION:.0%} of it = {fmt_bytes(budget)}",
        "ways out:",
    ]
    n = fp.num_params
    rest = one_seq + overhead + act
    # bits per weight of whole files; Q3_K_S and Q2_K scaled from Q4_K_M by llama-quantize's own
    # table (Llama-3-8B: 3.41, 2.96 and 4.58 GB): Qwen2-7B-Instruct Q2_K is ~3.0 GB
    for label, bits, gguf in (("a 4-bit GGUF of the same model (Q4_K_M)", 4.85, True),
                              ("a 3-bit GGUF of the same model (Q3_K_S)", 3.6, True),
                              ("a 2-bit GGUF of the same model (Q2_K)", 3.15, True),
                              ("an 8-bit quantization (int8 / Q8_0)", 8.5, False)):
        size = n * bits / 8
        verdict = "would fit here" if size + rest <= budget else "still too large here"
        share = (budget - rest) / size
        if gguf and size + rest > budget and share >= MAPPED_MIN_SHARE:  # mmap_weights
            verdict = (f"would run here with its blocks mapped from a file; the page cache "
                       f"holds ~{share:.0%} of them")
        lines.append(f"  - {label}: weights ~{fmt_bytes(size)} ({verdict})")
    if fp.weight_bytes < budget - overhead - act:
        fit_len = max(0, (budget - overhead - act - fp.weight_bytes) // fp.kv_bytes_per_token)
        fit_len = fit_len // block_size * block_size
        lines.append(f"  - a shorter max_model_len: {fit_len} tokens fit "
                     f"(KV {fmt_bytes(fp.kv_bytes_per_token)} per token)")
    itemsize = fp.weight_bytes / max(1, n)
    smaller = [(name, p) for name, p in FAMILY_SIZES.get(fp.arch.architecture, [])
               if p * itemsize + overhead + act < budget and p < n]
    if smaller:
        name, p = smaller[-1]
        lines.append(f"  - a smaller model of the same family: {name} (~{fmt_bytes(p * itemsize)}"
                     f" in {fp.dtype_name})")
    return "\n".join(lines)
