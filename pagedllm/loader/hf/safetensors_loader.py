"""Copy a Hugging Face safetensors checkpoint (one file or shards) into pre-allocated params."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.loader.errors import ModelFileError, read_json_object
from pagedllm.loader.fused import RowSlice, split_fused
from pagedllm.loader.progress import load_progress
from pagedllm.shard import Shard

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Copy at most this many elements per slice (32 MiB of float32).
CHUNK_ELEMENTS = 8 * 1024 * 1024
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    """safe_open, with safetensors' own errors (a bad header, data past the end) as a
    ModelFileError naming the file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ModelFileError(f"{file}: not a readable safetensors file ({err})") from None


def _weight_map(index: Path, model_dir: Path) -> dict[str, Path]:
    """Tensor name -> shard, from model.safetensors.index.json."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelFileError(f"{index} must have a 'weight_map' object of tensor name -> file name")
    missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
    if missing:
        raise FileNotFoundError(f"{index} names shards that are not in {model_dir}: "
                                f"{', '.join(missing)}")
    return {name: model_dir / file for name, file in weight_map.items()}


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _weight_map(index, model_dir)
    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() else sorted(
        model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    sources: dict[str, Path] = {}
    for file in files:
        with _open(file) as f:
            sources.update({name: file for name in f.keys()})
    return sources


# destination name -> (checkpoint name, the destination's rows in it when it is fused, else None)
Plan = dict[str, tuple[str, Optional[RowSlice]]]


def _plan(sources: Mapping[str, Path], params: Mapping[str, torch.Tensor],
          skip: Optional[Callable[[str], bool]] = None,
          shards: Optional[Mapping[str, Shard]] = None) -> Plan:
    """Where each destination comes from, or ValueError naming missing/unexpected tensors;
    tensors whose name `skip` accepts are left out; a fused tensor's shards take a tensor
    parallel rank's rows of their ranges (`shards`)."""
    skipped = {n for n in sources
               if n.endswith("rotary_emb.inv_freq") or (skip is not None and skip(n))}
    if _LM_HEAD not in params:
        skipped.add(_LM_HEAD)  # tied model: lm_head shares embed_tokens
    plan: Plan = {name: (name, None) for name in params if name in sources}
    for src in sources:
        if src in skipped:
            continue
        for part in split_fused(src, params, shards) or ():
            plan[part.name] = (src, part)
            skipped.add(src)
    if _LM_HEAD in params and _LM_HEAD not in sources and _EMBED in sources:
        plan[_LM_HEAD] = (_EMBED, None)  # tied checkpoint loaded into a model with its own lm_head
    missing = sorted(set(params) - set(plan))
    unexpected = sorted(set(sources) - set(params) - skipped)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing tensors {missing}, "
                         f"unexpected tensors {unexpected}")
    return plan


def _copy(f, src: str, dst: str, dest: torch.Tensor, part: Optional[RowSlice],
          shard: Optional[Shard] = None) -> None:
    """Copy one tensor (or, for a fused one, the part's rows, a tensor-parallel rank's already;
    for a tensor-parallel rank, its shard's rows or columns) from an open file into dest in
    row slices, casting to dest's dtype. Only the slices wanted are read (safetensors'
    get_slice)."""
    sl = f.get_slice(src)
    shape = tuple(sl.get_shape())
    want = tuple(dest.shape)
    if part is not None:
        shard = None  # the part is the rank's rows (fused.split_fused)
    if shard is not None:
        want = want[:shard.axis] + (shard.full,) + want[shard.axis + 1:]
    if part is not None and shape != (part.total, *dest.shape[1:]):
        raise ValueError(f"checkpoint tensor {src!r} has shape {shape} but its shards "
                         f"({dst!r} among them) take {(part.total, *dest.shape[1:])}")
    if part is None and shape != want:
        raise ValueError(f"{dst!r} has shape {want} but checkpoint tensor {src!r} "
                         f"has shape {shape}")
    if part is None and shard is None and (len(shape) < 2 or dest.numel() <= CHUNK_ELEMENTS):
        dest.copy_(sl[:])
        return
    start, rows = (0, dest.shape[0]) if part is None else (part.start, part.rows)
    cols = slice(None)
    if shard is not None and shard.axis == 0:
        start = shard.start
    elif shard is not None:
        cols = slice(shard.start, shard.stop)
    step = max(1, CHUNK_ELEMENTS // max(1, dest.numel() // rows))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        rows_read = slice(start + r0, start + r0 + n)
        dest[r0:r0 + n].copy_(sl[rows_read] if len(shape) < 2 else sl[rows_read, cols])


def load_safetensors_weights(model_dir: str | Path, params: Mapping[str, torch.Tensor],
                             skip: Optional[Callable[[str], bool]] = None,
                             shards: Optional[Mapping[str, Shard]] = None) -> None:
    """Fill pre-allocated params (HF names) from an HF checkpoint directory, tensor by tensor;
    tensors whose name `skip` accepts are not read; a param named in `shards` (a tensor
    parallel rank's) takes that part of its checkpoint tensor only."""
    sources = _tensor_files(Path(model_dir))
    plan = _plan(sources, params, skip, shards)
    with torch.no_grad():
        ordered = sorted(plan.items(), key=lambda item: str(sources[item[1][0]]))
        for dst, (src, part) in load_progress(ordered, model_dir):
            # One open per tensor: closing unmaps the file, so touched pages of
            # already-copied tensors stop counting towards resident memory.
            with _open(sources[src]) as f:
                _copy(f, src, dst, params[dst], part, (shards or {}).get(dst))
