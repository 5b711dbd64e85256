"""Pipeline stages: contiguous layer ranges per rank, as vLLM's get_pp_indices splits them."""
from __future__ import annotations

from dataclasses import dataclass


def get_pp_indices(num_layers: int, rank: int, world_size: int) -> tuple[int, int]:
    """Layers [start, end) of pipeline rank `rank`, as vLLM splits them: num_layers //
    world_size each, and the remainder one apiece to the stages just before the last (the last
    stage also computes the final norm and the logits, so it keeps the smaller share)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if world_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={world_size} is larger than the model's "
                         f"{num_layers} layers: each stage needs at least one")
    base, extra = divmod(num_layers, world_size)
    sizes = [base] * world_size
    for i in range(2, extra + 2):
        sizes[-i] += 1
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclass(frozen=True)
class PipelineStage:
    """One rank's share of the model: layers [start_layer, end_layer) of num_layers."""

    rank: int
    world_size: int
    start_layer: int
    end_layer: int
    num_layers: int

    @classmethod
    def of_rank(cls, num_layers: int, rank: int, world_size: int) -> "PipelineStage":
        """The stage of `rank` among world_size over num_layers layers."""
        start, end = get_pp_indices(num_layers, rank, world_size)
        return cls(rank, world_size, start, end, num_layers)

    @property
    def is_first(self) -> bool:
        """Embeds the tokens."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Computes the final norm, the logits and the sampled tokens."""
        return self.rank == self.world_size - 1

    @property
    def layers(self) -> range:
        """Indices of the decoder layers this stage holds."""
        return range(self.start_layer, self.end_layer)
