"""Plain-Python messages from the runner to the scheduler and from the core to the output processor."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union


class TokenLogprobs(NamedTuple):
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token, 1 = most likely


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one forward pass produced, keyed by request id."""

    sampled: dict[str, int]  # only requests whose scheduled tokens reached their end
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests that could not sample
    pooled: dict[str, Any] = field(default_factory=dict)  # pooling requests: [D] float32 CPU tensor
    # requests that verified drafts (not in `sampled`): the drafts kept, then the target's own
    # token after them; and the target's logprobs at each of those positions
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # a draft model's proposals (SchedulerOutput.draft_lengths): each request's drafts for its
    # next step, continuing its tokens with this step's sampled ones
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # of the step's time, the draft model's


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None  # finish_reason "error": what went wrong for this request
    pooled: Any = None  # a pooling request's result: [D] float32 CPU tensor

    @property
    def finished(self) -> bool:
        """True once the request will produce nothing more."""
        return self.finish_reason is not None
