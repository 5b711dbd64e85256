"""Decide what a model path points at (GGUF or HF safetensors dir) and load it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.loader.errors import read_json_object
from pagedllm.loader.gguf.weights import arch_from_gguf, load_gguf_weights
from pagedllm.loader.hf.arch import arch_from_hf_config
from pagedllm.loader.hf.hf_overrides import arch_with_overrides
from pagedllm.loader.hf.safetensors_loader import load_safetensors_weights
from pagedllm.shard import Shard

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint: its format, where it lives, its architecture, its tokenizer."""

    kind: Literal["gguf", "safetensors"]
    path: Path  # the .gguf file, or the HF directory
    arch: ModelArchConfig
    tokenizer_path: Path  # a directory with tokenizer files, or the .gguf file


def _gguf_checkpoint(gguf: Path, overrides: Optional[Mapping[str, Any]] = None) -> Checkpoint:
    """Checkpoint for a GGUF file; tokenizer files beside it win over its own metadata.
    hf_overrides are refused: a GGUF has no config.json to merge them over.

    Converting a GGUF vocabulary with transformers takes ~30 s for Qwen's 152k tokens; the
    files model_store exports next to the GGUF load in under a second.
    """
    if overrides:
        raise ValueError(f"hf_overrides {sorted(overrides)} apply to a Hugging Face "
                         f"checkpoint's config.json; {gguf.name} is a GGUF")
    tokenizer_dir = gguf.parent
    has_tokenizer = any((tokenizer_dir / n).is_file() for n in _TOKENIZER_FILES)
    return Checkpoint(kind="gguf", path=gguf, arch=arch_from_gguf(gguf),
                      tokenizer_path=tokenizer_dir if has_tokenizer else gguf)


def _resolve_dir(root: Path, overrides: Optional[Mapping[str, Any]]) -> Checkpoint:
    """Checkpoint for a directory: HF safetensors layout (its config.json with `overrides`
    merged over it), or exactly one .gguf."""
    # an index alone (weights not fetched yet) is enough to plan memory before downloading
    safetensors = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.safetensors.index.json"))
    ggufs = sorted(root.glob("*.gguf"))
    if safetensors:
        config = root / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{root} has *.safetensors but no config.json")
        cfg = read_json_object(config)
        arch = (arch_from_hf_config(cfg, config) if not overrides
                else arch_with_overrides(cfg, overrides, config))
        return Checkpoint(kind="safetensors", path=root, arch=arch, tokenizer_path=root)
    if len(ggufs) == 1:
        return _gguf_checkpoint(ggufs[0], overrides)
    if len(ggufs) > 1:
        raise ValueError(f"model={str(root)!r} holds {len(ggufs)} .gguf files "
                         f"({', '.join(p.name for p in ggufs)}); pass one file")
    if any(root.glob("*.bin")) or any(root.glob("*.pt")):
        raise ValueError(f"model={str(root)!r} holds only PyTorch .bin/.pt weights; "
                         "safetensors (or a .gguf file) are required")
    raise FileNotFoundError(f"model={str(root)!r} has neither *.safetensors weights nor a .gguf file")


def resolve_checkpoint(model: str | Path,
                       hf_overrides: Optional[Mapping[str, Any]] = None) -> Checkpoint:
    """Resolve a .gguf file, an HF safetensors directory, or a directory holding one .gguf;
    hf_overrides (vLLM's): keys merged over an HF checkpoint's config.json."""
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model={str(model)!r} does not exist")
    if path.is_dir():
        return _resolve_dir(path, hf_overrides)
    if path.suffix == ".gguf":
        return _gguf_checkpoint(path, hf_overrides)
    raise ValueError(f"model={str(model)!r} is a file but not a .gguf; "
                     "pass a .gguf file or a Hugging Face checkpoint directory")


def load_weights(ckpt: Checkpoint, params: Mapping[str, torch.Tensor],
                 skip: Optional[Callable[[str], bool]] = None,
                 shards: Optional[Mapping[str, Shard]] = None) -> None:
    """Fill the model's pre-allocated params from the checkpoint; tensors whose HF name `skip`
    accepts (another pipeline stage's) are neither read nor reported as unexpected; a param in
    `shards` (a tensor parallel rank's) reads its part of its tensor only."""
    if ckpt.kind == "gguf":
        load_gguf_weights(ckpt.path, params, skip, shards)
    else:
        load_safetensors_weights(ckpt.path, params, skip, shards)


def generation_config(ckpt: Checkpoint) -> dict[str, Any]:
    """generation_config.json of the checkpoint directory, or {} if there is none."""
    root = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    file = root / "generation_config.json"
    return read_json_object(file) if file.is_file() else {}
