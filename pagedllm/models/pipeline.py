"""A pipeline stage's share of a model: the modules other stages hold are replaced, before any
weight is allocated, by a placeholder without parameters, so this rank neither allocates nor
loads them (vLLM's PPMissingLayer). The model's forward then runs its own layers only."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from pagedllm.distributed.stage import PipelineStage


class IntermediateTensors(NamedTuple):
    """The residual stream between two pipeline stages: the last layer's output and the
    residual before it is added (the next layer's first norm adds them)."""

    hidden: torch.Tensor  # [T, H]
    residual: torch.Tensor  # [T, H] float32


class PPMissingLayer(nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def keep_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Drop, from a model built on the meta device, what other stages hold: the layers outside
    the stage's range, the embedding unless it is the first stage, the final norm and the
    output head unless it is the last. A tied head on a last stage that has no embedding gets
    its own copy of the embedding matrix (tie_weights leaves it untied)."""
    decoder = model.model
    for i in range(len(decoder.layers)):
        if i not in stage.layers:
            decoder.layers[i] = PPMissingLayer()
    if not stage.is_first:
        decoder.embed_tokens = PPMissingLayer()
    if not stage.is_last:
        decoder.norm = PPMissingLayer()
        model.lm_head = PPMissingLayer()
    model.layer_range = stage.layers


def holds_module(module: nn.Module) -> bool:
    """Whether this stage holds the module (it is not another stage's placeholder)."""
    return not isinstance(module, PPMissingLayer)


def held_elsewhere(stage: PipelineStage) -> Callable[[str], bool]:
    """Checkpoint name (HF) -> whether another stage holds that tensor: the loaders skip those
    without reading them."""
    def skip(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) not in stage.layers
        if name.startswith("model.embed_tokens."):
            return not stage.is_first
        if name.startswith(("model.norm.", "lm_head.")):
            return not stage.is_last
        return False

    return skip
