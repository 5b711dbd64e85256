"""POST /v2/embed's body, in Cohere's shape as vLLM serves it (its input_type picks one of the
model's prompts)."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import Int, RequestBody, _described

EmbeddingType = Literal["float", "binary", "ubinary", "base64"]


def _refused(schema: dict[str, Any]) -> None:
    """The schema of a field the server refuses when set: null only."""
    schema.update(anyOf=[{"type": "null"}])


class CohereEmbedRequest(RequestBody):
    """Cohere's v2 embed request: texts (images and mixed inputs are refused: the encoders
    pagedllm serves read text), an input_type naming a prompt of the model, the embedding
    types to answer with, and how to truncate (END, NONE; up to max_tokens)."""

    model: Optional[str] = None
    input_type: Optional[str] = None
    texts: Optional[list[str]] = None
    # the schemas state what the server takes (for clients and the API fuzz test); the
    # handler's refusals name the fields
    images: Optional[list[str]] = Field(None, json_schema_extra=_refused)
    inputs: Optional[list[Any]] = Field(None, json_schema_extra=_refused)
    output_dimension: Optional[Int] = _described(minimum=1)
    embedding_types: Optional[list[EmbeddingType]] = Field(default=None, min_length=1)
    truncate: Literal["NONE", "START", "END"] = _described("END", enum=["NONE", "END"])
    max_tokens: Optional[Int] = _described(minimum=1)
    priority: Int = _described(0, minimum=0, maximum=0)
