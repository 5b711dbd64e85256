"""Where each rank goes: its global rank, pipeline stage and tensor parallel rank (vLLM's
layout: stage by stage, each stage's TP ranks in order), which rank samples, and how the
start-up log names them. Used by the mp and the Ray executors alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_groups import driver_rank, global_rank
from pagedllm.distributed.stage import (PARTITION_ENV, PipelineStage, layer_partition,
                                       partition_spec)
from pagedllm.distributed.tensor_parallel import TensorParallelRank


@dataclass(frozen=True)
class RankPlace:
    """A worker process's place: its rank in the world group, and its pipeline stage, its
    tensor parallel rank, or both (global rank = stage * tensor_parallel_size + TP rank;
    distributed/parallel_groups.py)."""

    rank: int
    world_size: int
    stage: Optional[PipelineStage] = None
    tp: Optional[TensorParallelRank] = None

    @property
    def name(self) -> str:
        """How messages name it: "pipeline rank 1", "tensor parallel rank 1", "pipeline stage
        1, tensor parallel rank 0 (rank 2)"."""
        if self.tp is None:
            return f"pipeline rank {self.rank}"
        if self.stage is None:
            return f"tensor parallel rank {self.rank}"
        return (f"pipeline stage {self.stage.rank}, tensor parallel rank {self.tp.rank} "
                f"(rank {self.rank})")

    @property
    def layers(self) -> str:
        """" layers a-b" for a pipeline stage, else nothing (for the start-up log)."""
        if self.stage is None:
            return ""
        return f" layers {self.stage.start_layer}-{self.stage.end_layer - 1}"


def rank_places(config: EngineConfig) -> list[RankPlace]:
    """The places of the ranks the parallel config asks for, in global rank order: stage by
    stage, each stage's TP ranks in order (vLLM's layout)."""
    parallel = config.parallel
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    world = tp_size * pp_size
    layers = config.arch.num_hidden_layers
    # read here, in the driver, and carried in each place: a rank never reads the variable
    sizes = layer_partition(layers, pp_size) if pp_size > 1 else None
    places = []
    for pp_rank in range(pp_size):
        stage = PipelineStage.of_rank(layers, pp_rank, pp_size, sizes) if pp_size > 1 else None
        for tp_rank in range(tp_size):
            tp = TensorParallelRank(tp_rank, tp_size) if tp_size > 1 else None
            places.append(RankPlace(global_rank(pp_rank, tp_rank, tp_size), world, stage, tp))
    return places


def parallel_kind(places: list[RankPlace]) -> str:
    """What the ranks split, for the start-up log: "pipeline", "tensor" or "tensor x pipeline"."""
    first = places[0]
    if first.tp is None:
        return "pipeline"
    return "tensor" if first.stage is None else "tensor x pipeline"


def partition_note(places: list[RankPlace]) -> str:
    """" (VLLM_PP_LAYER_PARTITION=16,8)" when the stages follow that variable, else "" (for the
    start-up log, which lists each rank's layers)."""
    spec = partition_spec()
    return "" if places[0].stage is None or spec is None else f" ({PARTITION_ENV}={spec})"


def places_driver(places: list[RankPlace]) -> int:
    """The rank that samples and whose output is the step's: TP rank 0 of the last stage."""
    last = places[-1]
    return driver_rank(1 if last.tp is None else last.tp.world_size,
                       1 if last.stage is None else last.stage.world_size)
