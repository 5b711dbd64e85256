"""The planner's bandwidth model: one-stream decode speed from the bytes a token reads.

One-stream decode is bound by memory bandwidth (docs/performance.md): each token reads every
weight it multiplies once, what the page cache lacks of mapped blocks comes back from disk,
and split ranks add a message per hop. An estimate for ranking the ways a model could run,
not a measurement: the machine, its load and the kernels move the real figure.
"""
from __future__ import annotations

from typing import Sequence

from pagedllm.memory.plan import DISK_READ_BYTES_PER_S

# weights read per second by a one-stream decode step: the default model's measured decode
# (Qwen2.5-Coder-0.5B Q4_K_M, ~395 MB of blocks a token, 55.6 tok/s on a quiet 2-vCPU AMD
# EPYC Zen 4, README's headline figures) streams ~22 GB/s; torch.sum reads 25-28 GB/s there
WEIGHT_READ_BYTES_PER_S = 22_000_000_000
# one message between ranks (a pipeline hop or a tensor parallel all-reduce): ~1.2 ms between
# two local processes over gloo (docs/architecture.md); across machines it is more
MESSAGE_SECONDS = 1.2e-3


def rank_seconds(read_bytes: int, reread_bytes: int = 0) -> float:
    """Seconds one rank spends on a decode step: its weights from memory, what the page cache
    lacks of its mapped blocks from disk."""
    return read_bytes / WEIGHT_READ_BYTES_PER_S + reread_bytes / DISK_READ_BYTES_PER_S


def pipeline_tok_per_s(stage_seconds: Sequence[float]) -> float:
    """Tokens a second of one sequence through pipeline stages run one after another (a
    sequence's token passes every stage in turn; a message a hop)."""
    return 1.0 / (sum(stage_seconds) + MESSAGE_SECONDS * (len(stage_seconds) - 1))


def tensor_parallel_tok_per_s(slowest_rank_seconds: float, num_layers: int) -> float:
    """Tokens a second with every layer split over ranks that run at once: the slowest rank's
    share, and the all-reduces (the embedding's, then two a layer)."""
    return 1.0 / (slowest_rank_seconds + MESSAGE_SECONDS * (2 * num_layers + 1))
