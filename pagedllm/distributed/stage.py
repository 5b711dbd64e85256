"""Pipeline stages: contiguous layer ranges per rank, as vLLM's get_pp_indices splits them
(evenly, or as VLLM_PP_LAYER_PARTITION asks)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

# vLLM's variable: layer counts per stage, "16,8"; read in the driver only (the ranks get their
# stages from it, so Ray actors that do not inherit its environment still agree). Unlike vLLM,
# one process (pipeline_parallel_size=1, doctor) has no stages and ignores it, and a blank value
# counts as unset; zero or negative counts are refused (vLLM checks only the count and the sum)
PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def even_partition(num_layers: int, world_size: int) -> tuple[int, ...]:
    """vLLM's even split: num_layers // world_size each, and the remainder one apiece to the
    stages just before the last (the last stage also computes the final norm and the logits,
    so it keeps the smaller share)."""
    if world_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={world_size} is larger than the model's "
                         f"{num_layers} layers: each stage needs at least one")
    base, extra = divmod(num_layers, world_size)
    sizes = [base] * world_size
    for i in range(2, extra + 2):
        sizes[-i] += 1
    return tuple(sizes)


def parse_partition(spec: str, num_layers: int, world_size: int) -> tuple[int, ...]:
    """VLLM_PP_LAYER_PARTITION's value checked against the model and pipeline_parallel_size:
    one positive layer count per stage, summing to the model's layers."""
    allowed = (f"{PARTITION_ENV} must be {world_size} comma-separated layer counts >= 1, one "
               f"per pipeline stage, summing to the model's {num_layers} layers "
               f"(e.g. {','.join(map(str, even_partition(num_layers, world_size)))})"
               if world_size <= num_layers else
               f"pipeline_parallel_size={world_size} is larger than the model's {num_layers} "
               "layers: each stage needs at least one")
    try:
        sizes = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"{allowed}; got {spec!r}, which is not a list of integers") from None
    if len(sizes) != world_size:
        raise ValueError(f"{allowed}; got {spec!r}: {len(sizes)} entries for "
                         f"pipeline_parallel_size={world_size}")
    if min(sizes) < 1:
        raise ValueError(f"{allowed}; got {spec!r}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise ValueError(f"{allowed}; got {spec!r}, which sums to {sum(sizes)}")
    return sizes


def partition_spec() -> Optional[str]:
    """VLLM_PP_LAYER_PARTITION as set in this process, or None when unset or blank."""
    spec = os.environ.get(PARTITION_ENV, "").strip()
    return spec or None


def layer_partition(num_layers: int, world_size: int) -> tuple[int, ...]:
    """Layers per stage: VLLM_PP_LAYER_PARTITION's when set (checked), else the even split."""
    spec = partition_spec()
    if spec is None:
        return even_partition(num_layers, world_size)
    return parse_partition(spec, num_layers, world_size)


def get_pp_indices(num_layers: int, rank: int, world_size: int,
                   sizes: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """Layers [start, end) of pipeline rank `rank`, as vLLM gives them: of `sizes` (layers per
    stage) when given, else of layer_partition (VLLM_PP_LAYER_PARTITION or the even split)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if sizes is None:
        sizes = layer_partition(num_layers, world_size)
    assert len(sizes) == world_size and sum(sizes) == num_layers, (sizes, num_layers)
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
    def of_rank(cls, num_layers: int, rank: int, world_size: int,
                sizes: Optional[Sequence[int]] = None) -> "PipelineStage":
        """The stage of `rank` among world_size over num_layers layers (get_pp_indices)."""
        start, end = get_pp_indices(num_layers, rank, world_size, sizes)
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
