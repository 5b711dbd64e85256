"""Pooling parameters for one embedding request, with vLLM's field names and checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# what a pooling request may ask for: a vector (embed), a classification head's probabilities
# (classify) or a cross-encoder's relevance of a text pair (score)
POOLING_TASKS = ("embed", "classify", "score")
# vLLM's PoolingParams fields this engine does not implement: refused by name when set
_NOT_IMPLEMENTED = ("activation", "softmax", "step_tag_id", "returned_token_ids")
# extra_kwargs (vLLM's, internal): where a pair's second text starts (its token type 1)
SECOND_TEXT = "compressed_token_type_ids"


@dataclass
class PoolingParams:
    """dimensions: keep the first n values (Matryoshka models only); normalize: L2-normalise
    (None: as the model's files say); task: "embed", "classify" or "score";
    truncate_prompt_tokens: keep k tokens of a longer input (-1: max_model_len); use_activation:
    classify's and score's activation on the head's logits (None/True: apply it, False: the raw
    logits)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    task: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    activation: Optional[bool] = None
    softmax: Optional[bool] = None
    step_tag_id: Optional[int] = None
    returned_token_ids: Optional[list[int]] = None
    extra_kwargs: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive int, -1 (the model's "
                             f"max_model_len) or None, got {k!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r}")
        extra = self.extra_kwargs
        if extra is not None:
            if not isinstance(extra, dict) or set(extra) - {SECOND_TEXT}:
                raise ValueError(f"extra_kwargs may only hold {SECOND_TEXT!r}, got {extra!r}")
            start = extra.get(SECOND_TEXT)
            if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                      or start < 1):
                raise ValueError(f"extra_kwargs[{SECOND_TEXT!r}] must be a positive int, got "
                                 f"{start!r}")
        for name in _NOT_IMPLEMENTED:
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this engine's pooling requests")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive int or None, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task {self.task!r} is not supported; supported: "
                             f"{', '.join(POOLING_TASKS)}")

    def verify(self, hidden_size: int, matryoshka: bool,
               matryoshka_dimensions: Optional[tuple[int, ...]]) -> None:
        """Refuse dimensions the model cannot give: only Matryoshka-trained models may be cut
        (to one of their trained sizes where the model names them), as vLLM refuses, in its
        words after the field's; the model's own size is no cut and always allowed."""
        d = self.dimensions
        if d is None or d == hidden_size:
            return
        if not matryoshka and matryoshka_dimensions is None:
            raise ValueError(f"dimensions {d}: Model does not support matryoshka "
                             "representation, changing output dimensions will lead to poor "
                             f"results (its embeddings have {hidden_size} values)")
        if matryoshka_dimensions is not None and d not in matryoshka_dimensions:
            raise ValueError(f"dimensions {d}: Model only supports {list(matryoshka_dimensions)} "
                             "matryoshka dimensions, use other output dimensions will lead to "
                             "poor results")
        if d > hidden_size:
            raise ValueError(f"dimensions {d} is larger than the model's {hidden_size}")

    @property
    def second_text_start(self) -> Optional[int]:
        """Where a text pair's second text starts (its tokens have token type 1), or None."""
        return None if self.extra_kwargs is None else self.extra_kwargs.get(SECOND_TEXT)

    def clone(self) -> "PoolingParams":
        """A copy (vLLM's name)."""
        copy = PoolingParams(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        if copy.extra_kwargs is not None:
            copy.extra_kwargs = dict(copy.extra_kwargs)
        return copy


def model_tasks(labels: int) -> tuple[str, ...]:
    """What a pooling model serves: an encoder with a classification head of `labels` outputs
    classifies (and scores a pair when it has one output); one without embeds."""
    if not labels:
        return ("embed",)
    return ("classify", "score") if labels == 1 else ("classify",)


def check_pooling_task(task: Optional[str], arch: Any) -> str:
    """The task a request runs (None: the model's first), or a ValueError naming what the
    model serves. arch: the model's ModelArchConfig."""
    labels = arch.num_labels
    tasks = model_tasks(labels)
    if task is None:
        return tasks[0]
    if task not in tasks:
        why = ("it has no classification head: it embeds (LLM.score and /score compare its "
               "embeddings)" if not labels else
               f"its classification head has {labels} labels" +
               (", and only a one-label head scores a pair" if task == "score" else
                ": it classifies and does not embed"))
        raise ValueError(f"task {task!r} is not one this model serves ({', '.join(tasks)}): "
                         f"{why}")
    return task


def check_pooling_params(value: Any) -> PoolingParams:
    """value itself if it is PoolingParams (None: the defaults), else a ValueError."""
    if value is None:
        return PoolingParams()
    if not isinstance(value, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(value).__name__}")
    return value


def resolve_truncation(keep: Optional[int], max_model_len: int) -> Optional[int]:
    """truncate_prompt_tokens as a count of tokens to keep (-1: max_model_len; None: no cut);
    a ValueError naming it when it is larger than max_model_len, as vLLM refuses it."""
    keep = max_model_len if keep == -1 else keep
    if keep is not None and keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens is {keep}, larger than max_model_len "
                         f"({max_model_len})")
    return keep
