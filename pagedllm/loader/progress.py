"""A progress bar for loading weights (shown on a terminal, silent in logs and pipes)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def load_progress(items: list[T], source: str | Path) -> Iterable[T]:
    """Iterate items (tensors) with a 'loading weights' bar on stderr when it is a terminal."""
    return tqdm(items, desc=f"loading weights from {Path(source).name}", unit="tensor",
                disable=None, leave=False)
