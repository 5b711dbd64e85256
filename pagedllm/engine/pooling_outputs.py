"""Pooling requests between add and finish: their prompts, and their PoolingRequestOutputs."""
from __future__ import annotations

from typing import Optional

from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput


class PoolingOutputs:
    """Turns a pooling request's one engine-core output into its PoolingRequestOutput."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[Optional[str], list[int]]] = {}

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int]) -> None:
        """Track a pooling request."""
        self._prompts[request_id] = (prompt, list(prompt_token_ids))

    def owns(self, request_id: str) -> bool:
        """Whether request_id is a pooling request still tracked."""
        return request_id in self._prompts

    def abort(self, request_id: str) -> None:
        """Forget a request (aborted or gone)."""
        self._prompts.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """Any pooling request not yet finished."""
        return bool(self._prompts)

    def finish(self, out: EngineCoreOutput) -> PoolingRequestOutput:
        """The request's result (its vector, or why it failed); it is forgotten."""
        prompt, ids = self._prompts.pop(out.req_id)
        pooled = None if out.pooled is None else PoolingOutput(out.pooled)
        error = out.error if pooled is None else None
        if pooled is None and error is None:
            error = f"the request finished ({out.finish_reason}) without a pooled output"
        return PoolingRequestOutput(out.req_id, pooled, ids, True, prompt, error)
