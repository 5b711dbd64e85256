"""A request as the engine core sees it: token ids catching up with computation."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedllm.core.block_hash import BlockHash, hash_block_tokens
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request's own step failed; the others go on

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI/vLLM finish reason for a terminal state."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(eq=False)
class Request:
    """One sequence to generate: prompt, produced tokens and how many have KV computed."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    eos_token_ids: frozenset[int]
    block_size: int
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Union[int, str, None] = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    # structured_output.grammar.GrammarState: where the output is in its grammar (None: free)
    grammar: Optional[Any] = None
    error: Optional[str] = None  # why the request failed (status FINISHED_ERROR)
    # a pooling request: its whole prompt runs in one step, is pooled and finishes; its
    # sampling_params are the defaults and nothing reads them
    pooling_params: Optional[PoolingParams] = None
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with (None: the base)
    # OpenAI's `prediction`: the expected output's ids, searched first by the n-gram proposer
    prediction_token_ids: list[int] = field(default_factory=list)
    # a draft model's proposals for the next step (they continue all_token_ids)
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, and an encoder's keys depend
        on the tokens after them, so such requests skip the cache."""
        return self.pooling_params is None and self.sampling_params.prompt_logprobs is None

    def token_id(self, index: int) -> int:
        """Token at absolute position `index`."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token and hash any block it completes."""
        self.output_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= self.num_tokens:
            start = len(self.block_hashes) * bs
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = [self.token_id(i) for i in range(start, start + bs)]
            self.block_hashes.append(hash_block_tokens(parent, tokens, self.lora_int_id))

    @property
    def lora_int_id(self) -> Optional[int]:
        """The id of the request's LoRA adapter, or None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id
