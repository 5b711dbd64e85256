"""Where a model reference points: a local path, a shipped model, a Hub (or ModelScope) repo.

Remote models come in two phases so that memory is planned on metadata before any weight
byte is downloaded: `metadata_path` first, then `fetch()` for the weights.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from pagedllm.hub.model_store import ensure_model, known_models, model_spec


@dataclass(frozen=True)
class LocatedModel:
    """A model's metadata on disk, and how to get its weights (None: already local)."""

    metadata_path: str
    fetch: Optional[Callable[[], str]] = None

    def weights_path(self) -> str:
        """Download the weights if needed; the path to load."""
        return self.fetch() if self.fetch is not None else self.metadata_path


def unknown_reference(model: str, revision: Optional[str] = None,
                      gguf_file: Optional[str] = None) -> Optional[str]:
    """Why `model` names nothing pagedllm can load (not a local path, a shipped model name or a
    Hub repo id), or None. Cheap (no torch, no network), so the command line refuses first."""
    if os.path.exists(model) or model_spec(model) is not None:
        return None
    from pagedllm.hub.hub import parse_hub_ref

    if parse_hub_ref(model, revision, gguf_file) is not None:
        return None
    return (f"model={model!r} is neither an existing local path, a known model name, nor a "
            f"Hub repo id (owner/name); known models: {', '.join(known_models())}; local .gguf "
            "files and Hugging Face checkpoint directories are also accepted")


def locate_model(model: str, revision: Optional[str] = None, gguf_file: Optional[str] = None,
                 source: Optional[str] = None) -> LocatedModel:
    """Resolve a local path, a shipped model name, or a Hub repo id (owner/name[:file|:TAG]);
    source "modelscope" (or PAGEDLLM_USE_MODELSCOPE=1 / VLLM_USE_MODELSCOPE=1) uses ModelScope."""
    if os.path.exists(model):
        return LocatedModel(model)
    spec = model_spec(model)
    if spec is not None:
        return LocatedModel(str(ensure_model(spec.name)))
    from pagedllm.hub.hub import parse_hub_ref, prepare_hub_model

    ref = parse_hub_ref(model, revision, gguf_file)
    if ref is None:
        raise ValueError(unknown_reference(model, revision, gguf_file))
    prepared = prepare_hub_model(ref, source)
    return LocatedModel(str(prepared.metadata_path), prepared.fetch_weights)
