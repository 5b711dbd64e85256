"""A tensor-parallel rank's part of a GGUF tensor, as a piece of the file to read.

    column-parallel (axis 0): rows [r0, r1) -- contiguous bytes, in any format (a GGML block
                              never crosses a row)
    row-parallel (axis 1):    values [c0, c1) of every row -- bytes [b0, b1) of each row when
                              c0 and c1 fall on block boundaries; a float destination whose
                              range cuts blocks reads whole rows and keeps its values
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from gguf import GGML_QUANT_SIZES

from pagedllm.loader.gguf.header import GGUFTensorInfo
from pagedllm.shard import Shard


class Columns(NamedTuple):
    """The part of every row a tensor-parallel piece reads: bytes [start, start + size) of
    each row of row_stride bytes, of whose dequantized values `values` are the rank's (all of
    them when the part is whole blocks; else whole rows are read and cut after decoding)."""

    start: int
    size: int
    row_stride: int
    values: slice


def shard_piece(info: GGUFTensorInfo, name: str, shard: Shard, blocks: bool
                ) -> tuple[GGUFTensorInfo, Optional[Columns]]:
    """The piece of GGUF tensor `info` that param `name` (shard `shard` of it) loads, and for
    a row-parallel part, which part of each row; blocks: the destination keeps the blocks (its
    part must be whole blocks), else it is dequantized."""
    if info.shape[shard.axis] != shard.full:
        raise ValueError(f"{name!r} is split over tensor-parallel ranks as {shard.full} along "
                         f"axis {shard.axis}, but GGUF tensor {info.name!r} has shape "
                         f"{info.shape}")
    rows = 1 if len(info.shape) == 1 else info.shape[0]
    row_bytes = info.nbytes // rows
    if shard.axis == 0:
        unit = row_bytes if len(info.shape) > 1 else row_bytes // info.shape[0]
        piece = dataclasses.replace(info, shape=(shard.size, *info.shape[1:]),
                                    offset=info.offset + shard.start * unit,
                                    nbytes=shard.size * unit)
        return piece, None
    block, block_bytes = GGML_QUANT_SIZES[info.qtype]
    if shard.start % block == 0 and shard.size % block == 0:
        columns = Columns(shard.start // block * block_bytes, shard.size // block * block_bytes,
                          row_bytes, slice(None))
    elif blocks:
        raise ValueError(f"{name!r} keeps GGUF tensor {info.name!r}'s {info.qtype.name} blocks "
                         f"of {block} values, and its rank's values [{shard.start}, "
                         f"{shard.stop}) of each row are not whole blocks")
    else:
        columns = Columns(0, row_bytes, row_bytes, slice(shard.start, shard.stop))
    piece = dataclasses.replace(info, shape=(rows, shard.size), offset=info.offset + columns.start,
                                nbytes=rows * columns.size)
    return piece, columns
