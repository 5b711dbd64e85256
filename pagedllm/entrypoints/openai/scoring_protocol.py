"""Bodies of vLLM's pooling endpoints beyond /v1/embeddings: POST /score (a text pair's
relevance), /rerank (Jina's and Cohere's shape, also at /v1/rerank and /v2/rerank) and
/classify (a classification head's probabilities)."""
from __future__ import annotations

from typing import Optional, Union

from pagedllm.entrypoints.openai.protocol import Int, RequestBody, _described


class PoolingFields(RequestBody):
    """What every scoring body shares: the model, vLLM's truncation and activation switches."""

    model: Optional[str] = None
    truncate_prompt_tokens: Optional[Int] = None  # keep k tokens of a longer input (-1: all it takes)
    use_activation: Optional[bool] = None  # False: the head's raw logits
    user: Optional[str] = None  # OpenAI's end-user id: accepted, not used
    add_special_tokens: bool = True  # vLLM's; false (inputs without [CLS]/[SEP]) is refused

    def check_unsupported(self) -> None:
        """As every body's, and add_special_tokens=false refused by name."""
        super().check_unsupported()
        if not self.add_special_tokens:
            raise ValueError("add_special_tokens false is not supported by pagedllm's pooling "
                             "endpoints: the model reads its inputs with their special tokens")


class ScoreRequest(PoolingFields):
    """POST /score: text_1 against each text_2 (one text_1), or the two lists pair by pair."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankRequest(PoolingFields):
    """POST /rerank: documents ordered by their relevance to query, the top_n best (0 or
    unset: all), each with its text unless return_documents is false."""

    query: str
    documents: list[str]
    top_n: Optional[Int] = _described(minimum=0)
    return_documents: bool = True


class ClassifyRequest(PoolingFields):
    """POST /classify: input as a string or a list of strings."""

    input: Union[str, list[str]]
