"""A rank's part of one checkpoint tensor under tensor parallelism: what the loaders read
and the models' sharding plans name (a base module, so that loading needs no distributed/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """A rank's part of one checkpoint tensor: `size` of its `full` entries along `axis`, from
    `start` (axis 0: output rows; axis 1: the reduction axis, in every row)."""

    axis: int
    start: int
    size: int
    full: int

    @property
    def stop(self) -> int:
        """One past the last entry held."""
        return self.start + self.size
