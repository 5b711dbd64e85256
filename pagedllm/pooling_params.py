"""Pooling parameters for one embedding request, with vLLM's field names and checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

POOLING_TASKS = ("embed",)  # what a pooling request may ask for (vLLM also has classify, score)
# vLLM's PoolingParams fields this engine does not implement: refused by name when set
_NOT_IMPLEMENTED = ("truncate_prompt_tokens", "use_activation", "activation", "softmax",
                    "step_tag_id", "returned_token_ids")


@dataclass
class PoolingParams:
    """dimensions: keep the first n values (Matryoshka models only); normalize: L2-normalise
    (None: as the model's files say); task: "embed"."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    task: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    activation: Optional[bool] = None
    softmax: Optional[bool] = None
    step_tag_id: Optional[int] = None
    returned_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
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
        (to one of their trained sizes where the model names them), as vLLM refuses."""
        d = self.dimensions
        if d is None or d == hidden_size:
            return
        if not matryoshka and matryoshka_dimensions is None:
            raise ValueError(f"dimensions is {d}, but the model does not support Matryoshka "
                             f"representations: its embeddings have {hidden_size} values")
        if matryoshka_dimensions is not None and d not in matryoshka_dimensions:
            raise ValueError(f"dimensions {d} is not one the model supports: "
                             f"{list(matryoshka_dimensions)}")
        if d > hidden_size:
            raise ValueError(f"dimensions {d} is larger than the model's {hidden_size}")

    def clone(self) -> "PoolingParams":
        """A copy (vLLM's name)."""
        return PoolingParams(**{k: getattr(self, k) for k in self.__dataclass_fields__})


def check_pooling_params(value: Any) -> PoolingParams:
    """value itself if it is PoolingParams (None: the defaults), else a ValueError."""
    if value is None:
        return PoolingParams()
    if not isinstance(value, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(value).__name__}")
    return value
