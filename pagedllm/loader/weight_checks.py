"""Checks of loaded weights that cost next to nothing: NaN or inf in a norm weight or a bias.

Every token passes through each of them, so one bad value poisons every logit (the engine
then serves token 0 forever, silently); they are 1-D and small (~120 vectors for a 24-layer
model, ~2 ms in all). Matrices are not scanned: that would read every weight again at start-up.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from pagedllm.loader.errors import ModelFileError


def check_finite_vectors(params: Mapping[str, torch.Tensor], source: str | Path) -> None:
    """ModelFileError naming the first 1-D float parameter that holds NaN or inf."""
    for name, tensor in params.items():
        if tensor.dim() == 1 and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ModelFileError(f"{name} holds {bad} NaN or infinite values (of {tensor.numel()}) "
                                 f"in {source}: the checkpoint is corrupt")
