"""POST /v1/embeddings' body, in OpenAI's shape (and vLLM's extra normalize); /pooling's."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from pagedllm.entrypoints.openai.protocol import (_PROMPTS, Int, RequestBody, _described,
                                                  token_ids_not_bools)

EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings: input as a string, strings, token ids or lists of token ids."""

    model: Optional[str] = None
    input: EmbeddingInput = Field(json_schema_extra=lambda schema: schema.update(anyOf=_PROMPTS))
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int] = _described(minimum=1)
    user: Optional[str] = None  # OpenAI's end-user id: accepted, not used
    normalize: Optional[bool] = None  # vLLM's: None keeps the model's own (its Normalize module)
    truncate_prompt_tokens: Optional[Int] = None  # vLLM's: keep k tokens (-1: max_model_len)

    @field_validator("input", mode="before")
    @classmethod
    def _token_ids_not_bools(cls, value: Any) -> Any:
        return token_ids_not_bools(value, "input")

    def inputs(self) -> list[Union[str, list[int]]]:
        """The inputs as a list: texts, or token-id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise ValueError("input must not be empty")
        if all(isinstance(t, int) for t in value):
            return [list(value)]
        return list(value)


class PoolingRequest(EmbeddingRequest):
    """vLLM's POST /pooling: the embeddings body, and the task to pool for (embed, classify,
    score; unset: the model's own)."""

    task: Optional[str] = None
