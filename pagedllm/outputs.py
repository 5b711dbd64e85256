"""Results handed back to the user: RequestOutput holding one CompletionOutput per sample;
PoolingRequestOutput and EmbeddingRequestOutput for pooling models."""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union


@dataclass
class Logprob:
    """Log probability of one token, its rank in the vocabulary (1 = most likely), its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None because nothing predicts it.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    # The stop string or stop token id that ended the sequence; None for EOS or length.
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        """True once a finish reason ("stop", "length", "abort", "error") is set."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass
class RequestOutput:
    """Everything produced so far for one request: prompt and its completions."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    # set when this request failed on its own (finish_reason "error"); the engine went on
    error: Optional[str] = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}"
            + (f", error={self.error!r})" if self.error else ")")
        )


@dataclass
class PoolingOutput:
    """A pooling request's result: the pooled tensor (vLLM's name)."""

    data: "torch.Tensor"  # noqa: F821 - [D] float32 on the CPU


@dataclass
class PoolingRequestOutput:
    """One pooling request: its prompt's ids and the pooled output (vLLM's shape)."""

    request_id: str
    outputs: Optional[PoolingOutput]  # None when the request failed (error says why)
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None
    error: Optional[str] = None


def _view_fields(out: PoolingRequestOutput, wrap: Callable[[list[float]], Any]) -> tuple:
    """A typed view's fields of a successful pooling output (its data as floats in `wrap`), or
    a ValueError saying why the request failed."""
    if out.outputs is None:
        raise ValueError(f"request {out.request_id} failed: {out.error}")
    return (out.request_id, wrap(out.outputs.data.tolist()), out.prompt_token_ids, out.finished,
            out.prompt)


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (vLLM's name)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """Values in the embedding."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One embedding request: `.outputs.embedding` is the vector (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        """The embedding view of a (successful) pooling output."""
        return cls(*_view_fields(out, EmbeddingOutput))


@dataclass
class ClassificationOutput:
    """A classification head's probabilities, one per label (vLLM's name)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """Labels of the head."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """One classify request: `.outputs.probs` (vLLM's shape)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        """The classification view of a (successful) pooling output."""
        return cls(*_view_fields(out, ClassificationOutput))


@dataclass
class ScoringOutput:
    """The relevance of a text pair (vLLM's name): a cross-encoder's activated logit, or the
    cosine similarity of an embedding model's two vectors."""

    score: float


@dataclass
class ScoringRequestOutput:
    """One scored pair: `.outputs.score` (vLLM's shape); prompt_token_ids are the pair's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
