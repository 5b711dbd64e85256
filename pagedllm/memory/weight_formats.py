"""What each weight format of a float (HF) checkpoint costs and gives on the CPU: memory,
one-stream decode speed, perplexity.

Formats: fp32 and bf16 (dtype="float32" / "bfloat16", quantization="none": vLLM's behaviour),
bf16x8 (quantization="bf16", a bf16 checkpoint's default on the CPU: its bf16 matrices regrouped
for pagedllm's own kernels, float32 activations), int8 (quantization="int8": Q8_0 blocks made at
load, layers/quantization.py), int8_g128 (quantization="int8_g128": the same bytes, a scale per 128 values) and int4
(quantization="int4": Q4_1 matrices, embedding and head in Q8_0).

- Memory comes from the checkpoint's tensor table (memory/weight_layout.py's weight_layout, as
  the planner reads it): resident weights, and the load's peak (int8/int4: made slice by slice
  as the float tensors are read, then regrouped for the kernels: the blocks twice).
- Speed: a decode step reads every matrix once, so one stream decodes at most
  READ_BYTES_PER_S / (bytes read per step) tokens a second (the bandwidth bound). Small models
  on few cores are compute-bound well below it, so MEASURED also keeps the measured rate.
- Perplexity on the shipped text (eval/perplexity.py) is measured, not modelled: MEASURED holds
  it for the default model, regenerated with

      PYTHONPATH=. .venv/bin/python benchmarks/bench_weight_formats.py

  (docs/performance.md has the whole table and the machine).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.config import ModelArchConfig
from pagedllm.memory.head_screen import screen_bytes, screen_planned
from pagedllm.memory.weight_layout import AT_LOAD_BYTES, WeightLayout
from pagedllm.platforms.interface import fmt_bytes

# memory read bandwidth of 2 threads, benchmarks/mem_bandwidth.cpp, best of 3 runs on the
# project's 2-vCPU AMD EPYC Zen 4 VM (quiet; docs/performance.md)
READ_BYTES_PER_S = 30.7e9

# format -> (LLM() arguments, bytes per matrix value, bytes per embedding/head value)
FORMATS: dict[str, tuple[str, float, float]] = {
    "fp32": ('dtype="float32", quantization="none"', 4.0, 4.0),
    "bf16": ('dtype="bfloat16", quantization="none"', 2.0, 2.0),
    "bf16x8": ('quantization="bf16"', *AT_LOAD_BYTES["bf16"]),  # bf16, regrouped (x8_bf16.cpp)
    "int8": ('quantization="int8"', *AT_LOAD_BYTES["int8"]),  # Q8_0: 32 int8 + an fp16 scale
    # Q8_0G4: the same bytes (a group's 4 blocks each carry its scale)
    "int8_g128": ('quantization="int8_g128"', *AT_LOAD_BYTES["int8_g128"]),
    "int4": ('quantization="int4"', *AT_LOAD_BYTES["int4"]),  # Q4_1: 32 nibbles + scale, min
}


# the formats whose matrices are made as the loader reads the float tensors
MADE_AT_LOAD = frozenset({"int8", "int8_g128", "int4", "bf16x8"})


@dataclass(frozen=True)
class Measured:
    """One format of one model, measured (benchmarks/bench_weight_formats.py)."""

    perplexity: float
    # one stream, 100-token prompt, 128 tokens, best of 2 on the 2-vCPU Zen 4 (busy), 2026-12-02
    decode_tok_per_s: float


# (architecture, hidden size, layers, vocab) of the measured model -> its name and formats
_QWEN_CODER_05B = ("qwen2", 896, 24, 151936)
MEASURED: dict[tuple[str, int, int, int], tuple[str, dict[str, Measured]]] = {
    _QWEN_CODER_05B: ("qwen2.5-coder-0.5b-instruct (HF export of the Q4_K_M GGUF)", {
        "fp32": Measured(6.124, 4.2),  # bf16 and fp32 speeds: before the bf16 kernels
        "bf16": Measured(6.128, 4.9),
        "int8": Measured(6.089, 38.9),
        "int4": Measured(6.834, 48.2),
    }),
}


@dataclass(frozen=True)
class FormatCost:
    """What one weight format costs and gives for one checkpoint."""

    name: str  # "fp32", "bf16", "bf16x8", "int8", "int8_g128", "int4"
    how: str  # the LLM() arguments that choose it
    weight_bytes: int  # resident after the load
    load_peak_bytes: int  # weights held at the load's peak
    step_bytes: int  # weight bytes one decode step reads (greedy)
    decode_bound_tok_per_s: float  # at READ_BYTES_PER_S
    measured: Optional[Measured]  # this model measured (None: not measured)
    # bf16x8: the greedy head's int8 screen (layers/head_screen.py), in weight_bytes; a greedy
    # step reads it instead of the bf16 head
    screen_bytes: int = 0

    def describe(self) -> str:
        """One clause: memory, the speed bound, and what was measured."""
        text = (f"{self.name} ({self.how}): weights {fmt_bytes(self.weight_bytes)}"
                + (f" (load peak {fmt_bytes(self.load_peak_bytes)})"
                   if self.load_peak_bytes > self.weight_bytes else "")
                + (f" with the greedy head's int8 screen ({fmt_bytes(self.screen_bytes)})"
                   if self.screen_bytes else "")
                + f", one-stream decode at most ~{self.decode_bound_tok_per_s:.0f} tok/s"
                + (" greedy" if self.screen_bytes else "")
                + f" at {READ_BYTES_PER_S / 1e9:.1f} GB/s")
        if self.measured is not None:
            text += (f", measured {self.measured.decode_tok_per_s:.1f} tok/s and perplexity "
                     f"{self.measured.perplexity:.3f} on the shipped text")
        return text


def measured_model(arch: ModelArchConfig) -> Optional[tuple[str, dict[str, Measured]]]:
    """The measured model this architecture is (its name and formats), or None."""
    return MEASURED.get((arch.architecture, arch.hidden_size, arch.num_hidden_layers,
                         arch.vocab_size))


def format_costs(arch: ModelArchConfig, values: WeightLayout) -> dict[str, FormatCost]:
    """Each format's cost for a checkpoint; values: its weight_layout at itemsize 1 (a count
    of values). Norms and biases are counted as matrices (well under 1 % of the bytes)."""
    known = measured_model(arch)
    matrices = sum(values.layers) + values.other
    # a tied head reads the embedding matrix each step; an untied one reads its own
    big = values.embedding + values.head
    step_big = values.embedding + values.head if values.tied else values.head
    costs = {}
    screen = screen_bytes(arch) if screen_planned(arch, "bf16", True, "generate", 1) else 0
    for name, (how, per_matrix, per_big) in FORMATS.items():
        weights = int(matrices * per_matrix + big * per_big)
        step = int(matrices * per_matrix + step_big * per_big)
        held = screen if name == "bf16x8" else 0
        if held:  # greedy steps read the head's Q8_0 copy instead of its bf16 rows
            weights, step = weights + held, step - int(step_big * per_big) + held
        # int8/int4/bf16x8 are made slice by slice as the float tensors are read, then
        # regrouped for the kernels (model_loader): the blocks held twice at the peak (bf16x8:
        # one matrix at a time, footprint.regrouped_bytes; bounded by the largest part)
        peak = (weights + int(max(max(values.layers, default=0) * per_matrix, big * per_big))
                if name == "bf16x8" else 2 * weights if name in MADE_AT_LOAD else weights)
        costs[name] = FormatCost(name, how, weights, peak, step, READ_BYTES_PER_S / max(1, step),
                                 None if known is None else known[1].get(name), held)
    return costs


def format_of(dtype_name: str, quantization: str) -> Optional[str]:
    """The FORMATS name of an engine's (dtype, quantization), or None (a GGUF's own blocks,
    float16)."""
    if quantization in ("int8", "int8_g128", "int4"):
        return quantization
    if quantization == "bf16":
        return "bf16x8"
    if quantization == "none":
        return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype_name)
    return None


def format_summary(costs: dict[str, FormatCost], chosen: str) -> str:
    """The start-up log's line: the chosen format's cost, and what the other choice (int8
    beside a float format, bf16 beside a quantized one) would give."""
    other = "int8" if chosen in ("fp32", "bf16", "bf16x8") else "bf16x8"
    return (f"weight format {costs[chosen].describe()}; instead {costs[other].describe()} "
            "(benchmarks/bench_weight_formats.py measures them)")
