"""vLLM's hf_overrides: keys merged over a checkpoint's config.json before it is read. A key
that nothing reads is refused by name, so that no override is silently without effect."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

from pagedllm.config import ModelArchConfig
from pagedllm.loader.hf.arch import arch_from_hf_config


class _ReadKeys(Mapping[str, Any]):
    """A config dict that remembers which keys were looked up (get, [], in)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values, self.read = values, set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def arch_with_overrides(cfg: Mapping[str, Any], overrides: Mapping[str, Any],
                        source: str | Path) -> ModelArchConfig:
    """The architecture of config.json `cfg` with `overrides` merged over its top-level keys
    (each replaces the checkpoint's value whole); a ValueError names the override keys that
    this engine does not read for this model."""
    merged = _ReadKeys({**cfg, **overrides})
    arch = arch_from_hf_config(merged, f"{source} with hf_overrides")
    unread = sorted(set(overrides) - merged.read)
    if unread:
        raise ValueError(f"hf_overrides {unread}: pagedllm does not read "
                         f"{'this key' if len(unread) == 1 else 'these keys'} of a "
                         f"{arch.architecture} checkpoint's config.json, so the override "
                         "would have no effect")
    return arch
