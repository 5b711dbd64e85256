"""A block-format weight that the loader fills with float rows, encoded as they arrive.

quantization="int8"/"int4" on a float checkpoint: the model is built with its block-format
modules (as for a GGUF's kept blocks) and each block weight is handed to the loader wrapped in
EncodedRows. It looks like the float matrix the checkpoint holds (shape, numel, row slices,
copy_), so the safetensors loader's row-sliced copy needs no change; each copy_ quantizes its
rows into the blocks at once. The float matrix never exists whole: the load holds the blocks
and one slice (then the blocks twice while they are regrouped for the kernels), where
quantizing a loaded float model held the float model and its blocks at once.
"""
from __future__ import annotations

from typing import Callable

import torch

# float rows [n, cols] -> their block bytes [n, row bytes]
Encoder = Callable[[torch.Tensor], torch.Tensor]


class EncodedRows:
    """The float [rows, cols] view of a block weight `blocks` [rows, row bytes]."""

    def __init__(self, blocks: torch.Tensor, cols: int, dtype: torch.dtype, encode: Encoder) -> None:
        self.blocks, self.cols, self.dtype, self.encode = blocks, cols, dtype, encode

    @property
    def shape(self) -> torch.Size:
        """The float matrix's shape, as the checkpoint's tensor has it."""
        return torch.Size((self.blocks.shape[0], self.cols))

    def numel(self) -> int:
        """Elements of the float matrix."""
        return self.blocks.shape[0] * self.cols

    def dim(self) -> int:
        """Always a matrix."""
        return 2

    def is_floating_point(self) -> bool:
        """What the checkpoint's tensor is (the blocks themselves are bytes)."""
        return True

    def __getitem__(self, rows: slice) -> EncodedRows:
        if not isinstance(rows, slice):
            raise TypeError(f"EncodedRows takes row slices only, not {type(rows).__name__}")
        return EncodedRows(self.blocks[rows], self.cols, self.dtype, self.encode)

    def copy_(self, rows: torch.Tensor) -> EncodedRows:
        """Quantize float rows [n, cols] (cast to the model's dtype first, as a float load
        would) into these blocks."""
        if tuple(rows.shape) != tuple(self.shape):
            raise ValueError(f"rows of shape {tuple(rows.shape)} do not fit block rows of "
                             f"shape {tuple(self.shape)}")
        self.blocks.copy_(self.encode(rows.to(self.dtype)))
        return self
