"""Whether a model gets the greedy head's int8 screen (layers/head_screen.py), and its bytes: the
planner's side, on metadata, so that the memory plan holds the copy before the load makes it."""
from __future__ import annotations

import os

from pagedllm.config import ModelArchConfig

ENV = "PAGEDLLM_HEAD_SCREEN"
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def screen_bytes(arch: ModelArchConfig) -> int:
    """Bytes of the screen of this model's head: its Q8_0 copy and three float norms a row."""
    return arch.vocab_size * (arch.hidden_size // Q8_BLOCK * Q8_BLOCK_BYTES + 3 * 4)


def screen_planned(arch: ModelArchConfig, quantization: str, on_cpu: bool, runner: str,
                   world_size: int) -> bool:
    """Whether a model with these settings gets a head screen (and its bytes are planned)."""
    gemma = arch.gemma
    return (os.environ.get(ENV, "1") != "0" and on_cpu and quantization == "bf16"
            and runner == "generate" and world_size == 1 and not arch.is_encoder
            and arch.hidden_size % Q8_BLOCK == 0 and arch.vocab_size % 8 == 0
            and (gemma is None or gemma.final_logit_softcapping is None))
