"""SchedulerOutput: the one message from the scheduler to the model runner; it carries only what changed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen yet (or one resumed after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + any output produced before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: Optional[PoolingParams] = None  # a pooling request: pooled, not sampled
    lora_request: Optional[LoRARequest] = None  # its adapter (None: the base model)


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: its tokens since the runner last saw it (the one
    sampled in its previous step: every rank appends them, the sampling one too), new blocks
    and the computed count."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int]


@dataclass(frozen=True)
class GrammarBitmask:
    """The ids each constrained request may sample this step: one row after its last token,
    and with drafts one more after each (a verify's rows: after the last token, after draft
    1, ..., after draft k), a request's rows consecutive and in that order."""

    req_ids: list[str]  # row r of the bitmask belongs to req_ids[r]
    bitmask: Any  # torch int32 [rows, ceil(vocab / 32)], bit set = allowed


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute this step: per request, how many tokens from num_computed_tokens on."""

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step, in batch order
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    grammar: Optional[GrammarBitmask] = None  # None when no sampling request is constrained
    # speculative decoding: req_id -> draft ids to verify after its last token; they are the
    # last len(drafts) of its num_scheduled_tokens
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # a draft model (speculative_config method "draft_model"): req_id -> how many drafts the
    # runner proposes after this step for a request that samples in it (its blocks already
    # hold that many slots past the step's tokens: the draft writes their keys); 0 for a prompt
    # chunk of a request that will draft: the draft reads it too
    draft_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute."""
        return not self.num_scheduled_tokens
