"""Batch sampling: SamplingMetadata in, SamplerOutput out."""

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    compute_prompt_logprobs,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
]
