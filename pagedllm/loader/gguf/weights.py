"""Load a GGUF's tensors into HF-named params (dequantized, or as blocks), and its architecture.

The header is read and checked by header.py, its metadata turned into a ModelArchConfig by
arch.py; this module plans and copies the tensor payloads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Collection, Iterator, Mapping, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm.config import ModelArchConfig
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.fused import (RowSlice, shard_modules, split_fused, split_stacked,
                                   stacked_modules)
from pagedllm.loader.gguf.arch import arch_from_header
from pagedllm.loader.gguf.encoder import bert_hf_name
from pagedllm.loader.gguf.header import GGUFTensorInfo, gguf_arrays, gguf_header
from pagedllm.loader.gguf.rope import ROPE_FACTOR_TENSORS, with_rope_factors
from pagedllm.loader.gguf.shards import Columns, shard_piece
from pagedllm.loader.gguf.vocab_checks import check_vocab_header
from pagedllm.loader.progress import load_progress
from pagedllm.shard import Shard

# Dequantize at most this many float32 elements at a time (32 MiB).
CHUNK_ELEMENTS = 8 * 1024 * 1024

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # fused (Phi-3): split by loader/fused.py
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Qwen MoE: the router, the experts stacked [experts, rows, cols] (split per expert by
    # loader/fused.py), and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_GEMMA_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Per architecture (registry key), layer tensors whose HF name differs: llama.cpp's Phi-3 holds
# gate and up fused in ffn_up.
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
}
# llama.cpp's converter stores Gemma's norm weights as 1 + w, the factor they scale by; the
# model holds w, as transformers does (Gemma 3's q/k norms too)
_NORMS_PLUS_ONE = ("gemma2", "gemma3")


@dataclass(frozen=True)
class _GGUFHeader:
    """Everything loading needs from a GGUF, without its tensor payloads."""

    arch: ModelArchConfig
    tensors: tuple[GGUFTensorInfo, ...]


def hf_name(gguf_name: str, architecture: str = "llama") -> Optional[str]:
    """HF parameter name for a GGUF tensor name of a model of `architecture` (registry key), or
    None if it has no counterpart."""
    if architecture == "bert":
        return bert_hf_name(gguf_name)
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    local = _ARCH_LAYER_NAMES.get(architecture, {}).get(parts[2]) or _LAYER_NAMES.get(parts[2])
    return None if local is None else f"model.layers.{parts[1]}.{local}"


def _read_header(path: str | Path) -> _GGUFHeader:
    """Parse metadata and tensor table; of the payloads, only the rope factor tensors (a few
    floats) are read, into the architecture."""
    fields, tensors = gguf_header(path)
    check_vocab_header(fields, gguf_arrays(path), tensors, path)  # before a tokenizer is built
    arch = arch_from_header(fields, tensors, path)
    wanted = [info for info in tensors if info.name in ROPE_FACTOR_TENSORS]
    if wanted:
        with open(path, "rb", buffering=0) as fh:
            factors = {info.name: dequantize(_read_bytes(fh, info.offset, info.nbytes),
                                             info.qtype).reshape(-1).tolist() for info in wanted}
        arch = with_rope_factors(arch, fields, factors, path)
    return _GGUFHeader(arch=arch, tensors=tensors)


def arch_from_gguf(path: str | Path) -> ModelArchConfig:
    """ModelArchConfig from a GGUF file's metadata."""
    return _read_header(path).arch


def gguf_quant_plan(path: str | Path, kernel_types: frozenset) -> dict[str, GGMLQuantizationType]:
    """Module name -> block format, for each matrix (2-D, or 3-D stacked experts: each expert's
    matrix) whose GGUF type is in kernel_types."""
    header = _read_header(path)
    plan: dict[str, GGMLQuantizationType] = {}
    for info in header.tensors:
        name = hf_name(info.name, header.arch.architecture)
        matrix = len(info.shape) in (2, 3) and info.qtype in kernel_types
        if name and name.endswith(".weight") and matrix:
            module = name.removesuffix(".weight")
            # a fused tensor: each of its shards; a stacked one: each expert
            split = (stacked_modules(module, info.shape[0]) if len(info.shape) == 3
                     else shard_modules(module))
            for shard in split or (module,):
                plan[shard] = info.qtype
    if header.arch.tie_word_embeddings and "model.embed_tokens" in plan:
        plan["lm_head"] = plan["model.embed_tokens"]  # the head shares the embedding's blocks
    return plan


def _read_bytes(fh: BinaryIO, offset: int, nbytes: int) -> np.ndarray:
    """nbytes at offset as a fresh uint8 array (plain reads: no mmap pages stay resident)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    _read_into(fh, offset, buf)
    return buf


def _read_into(fh: BinaryIO, offset: int, buf: np.ndarray) -> None:
    """Fill the contiguous uint8 array buf with the bytes at offset."""
    view = memoryview(buf).cast("B")
    fh.seek(offset)
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            raise ModelFileError(f"{fh.name}: the file ends inside a tensor at byte {offset + got} "
                                 "(it changed after its header was checked?)")
        got += n


def unpermute_qk_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> HF rotate_half) on whole heads."""
    # Within each head llama.cpp stores rows as [d0, d_half, d1, d_half+1, ...].
    n_heads = rows.shape[0] // head_dim
    return rows.reshape(n_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _read_rows(fh: BinaryIO, info: GGUFTensorInfo, r0: int, n: int, row_bytes: int,
               columns: Optional[Columns]) -> np.ndarray:
    """Rows [r0, r0 + n) of a piece as uint8 [n, row_bytes]; with columns, each row's part
    read on its own (the others' bytes are never read)."""
    if columns is None:
        return _read_bytes(fh, info.offset + r0 * row_bytes, n * row_bytes).reshape(n, row_bytes)
    buf = np.empty((n, columns.size), dtype=np.uint8)
    for i in range(n):
        _read_into(fh, info.offset + (r0 + i) * columns.row_stride, buf[i])
    return buf


def _copy_tensor(fh: BinaryIO, info: GGUFTensorInfo, dest: torch.Tensor,
                 head_dim: Optional[int], columns: Optional[Columns] = None) -> None:
    """Dequantize one tensor into dest in row chunks (a uint8 dest takes the blocks as they are);
    head_dim set means un-permute Q/K rows; columns: a part of every row only."""
    # 1-D norms and biases are small: one row.
    rows, cols = (1, info.shape[0]) if len(info.shape) == 1 else info.shape
    row_bytes = info.nbytes // rows
    if dest.dtype == torch.uint8:
        if head_dim is None and columns is None:  # blocks as they are: straight into dest
            _read_into(fh, info.offset, dest.view(-1).numpy())
            return
        cols = row_bytes
    step = max(1, CHUNK_ELEMENTS // cols)
    if head_dim is not None:
        step = max(head_dim, step // head_dim * head_dim)  # a head's rows must stay together
    flat = dest.view(rows, cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        raw = _read_rows(fh, info, r0, n, row_bytes, columns)  # [n, bytes read per row]
        # [n, cols]: float32 values, or the blocks themselves for a block-format destination
        chunk = raw if dest.dtype == torch.uint8 else dequantize(raw, info.qtype).reshape(n, -1)
        if columns is not None and dest.dtype != torch.uint8:
            chunk = chunk[:, columns.values]
        if head_dim is not None:
            chunk = unpermute_qk_rows(chunk.reshape(-1, 1) if len(info.shape) == 1 else chunk,
                                      head_dim)
            chunk = chunk.reshape(n, cols)
        flat[r0:r0 + n].copy_(torch.from_numpy(np.ascontiguousarray(chunk)))


def _check_shape(name: str, dest: torch.Tensor, info: GGUFTensorInfo) -> None:
    """ValueError naming both tensors unless dest has the GGUF tensor's (torch-order) shape
    (for a uint8 block-format destination: [rows, bytes per row]; a 1-D tensor fills a
    one-row matrix, as llama.cpp reads Qwen2-MoE's shared-expert gate either way)."""
    want = info.shape
    if len(want) == 1 and dest.dim() == 2 and dest.shape[0] == 1:
        want = (1, *want)
    if dest.dtype == torch.uint8 and len(want) == 2:
        want = (want[0], info.nbytes // want[0])
    if tuple(dest.shape) != want:
        raise ValueError(f"{name!r} has shape {tuple(dest.shape)} but GGUF tensor "
                         f"{info.name!r} has shape {info.shape}")


def _as_matrix(info: GGUFTensorInfo) -> GGUFTensorInfo:
    """A stacked [experts, rows, cols] tensor as the matrix [experts * rows, cols] it is in the
    file; a matrix as it is."""
    if len(info.shape) != 3:
        return info
    return dataclasses.replace(info, shape=(info.shape[0] * info.shape[1], info.shape[2]))


def _row_slice(info: GGUFTensorInfo, part: RowSlice) -> GGUFTensorInfo:
    """The rows of a fused or stacked GGUF tensor that one shard (expert) loads, as a tensor
    of its own (rows are whole blocks, so a row range is valid in any block format)."""
    info = _as_matrix(info)
    if info.shape[0] != part.total:
        raise ValueError(f"GGUF tensor {info.name!r} has shape {info.shape} but its shards "
                         f"({part.name!r} among them) have {part.total} rows in all")
    row_bytes = info.nbytes // info.shape[0]
    piece = dataclasses.replace(info, shape=(part.rows, *info.shape[1:]),
                                offset=info.offset + part.start * row_bytes,
                                nbytes=part.rows * row_bytes)
    return piece


Plan = list[tuple[GGUFTensorInfo, str]]


def _plan(header: _GGUFHeader, params: Mapping[str, torch.Tensor],
          skip: Optional[Callable[[str], bool]] = None,
          shards: Optional[Mapping[str, Shard]] = None) -> tuple[Plan, dict[str, Columns]]:
    """(source tensor, destination name) pairs covering every param exactly once, and the
    row parts read of the params a tensor-parallel rank holds columns of; tensors whose HF
    name `skip` accepts are left out, params in `shards` get their part of their tensor."""
    plan: Plan = []
    columns: dict[str, Columns] = {}
    shards = shards or {}
    embed: Optional[GGUFTensorInfo] = None

    def add(info: GGUFTensorInfo, name: str, rows_taken: bool = False) -> None:
        # rows_taken: info is already the rank's rows (a fused or stacked tensor's part)
        if name not in shards or (rows_taken and shards[name].axis == 0):
            _check_shape(name, params[name], info)
            plan.append((info, name))
            return
        piece, cols = shard_piece(info, name, shards[name], params[name].dtype == torch.uint8)
        _check_shape(name, params[name], piece)
        plan.append((piece, name))
        if cols is not None:
            columns[name] = cols

    for info in header.tensors:
        name = hf_name(info.name, header.arch.architecture)
        if name is None:
            if info.name in ROPE_FACTOR_TENSORS:  # read into the architecture's rope_scaling
                continue
            raise ValueError(f"unexpected GGUF tensor {info.name!r} (no HF parameter for it)")
        if info.name == "token_embd.weight":
            embed = info  # a tied head loads it, even on a pipeline stage without the embedding
        if skip is not None and skip(name):
            continue
        parts = split_fused(name, params, shards) or split_stacked(name, params, shards)
        if parts is not None:
            for part in parts:  # an expert's down_proj: then its rank's columns
                add(_row_slice(info, part), part.name, rows_taken=True)
            continue
        if name not in params:
            raise ValueError(f"unexpected GGUF tensor {info.name!r}: the model has no {name!r}")
        add(info, name)
    filled = {name for _, name in plan}
    if "lm_head.weight" in params and "lm_head.weight" not in filled and embed is not None:
        add(embed, "lm_head.weight")  # untied model, tied checkpoint
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"GGUF has no tensor for parameters: {', '.join(missing)}")
    return plan, columns


def load_gguf_weights(path: str | Path, params: Mapping[str, torch.Tensor],
                      skip: Optional[Callable[[str], bool]] = None,
                      shards: Optional[Mapping[str, Shard]] = None) -> None:
    """Fill pre-allocated float tensors (HF names) from a GGUF, streaming one chunk at a time;
    tensors whose HF name `skip` accepts are not read; params in `shards` (a tensor parallel
    rank's) read their part of their tensor only."""
    with GGUFWeightReader(path, params, skip, shards) as reader:
        reader.load(reader.names())


class GGUFWeightReader:
    """A GGUF's tensors planned onto a model's params once (but those `skip` accepts, which
    another pipeline stage holds; a tensor-parallel rank's part of those in `shards`), then
    loaded in any subsets (the file-backed weights load one matrix at a time)."""

    def __init__(self, path: str | Path, params: Mapping[str, torch.Tensor],
                 skip: Optional[Callable[[str], bool]] = None,
                 shards: Optional[Mapping[str, Shard]] = None) -> None:
        self.path, self.params = path, params
        self.header = _read_header(path)
        for name, tensor in params.items():
            kind_ok = tensor.is_floating_point() or tensor.dtype == torch.uint8
            if not kind_ok or not tensor.is_contiguous():
                raise ValueError(f"destination {name!r} must be a contiguous float or uint8 "
                                 f"(block format) tensor (dtype {tensor.dtype}, "
                                 f"contiguous={tensor.is_contiguous()})")
        self.plan, self.columns = _plan(self.header, params, skip, shards)
        self._fh = open(path, "rb", buffering=0)

    def names(self) -> list[str]:
        """The params the plan fills, in file order."""
        return [name for _, name in self.plan]

    def load(self, names: Collection[str], progress: bool = True) -> None:
        """Fill the params named (a progress bar on a terminal unless progress is False)."""
        wanted = set(names)
        todo = [(info, name) for info, name in self.plan if name in wanted]
        for info, name in load_progress(todo, self.path) if progress else todo:
            _copy_tensor(self._fh, info, self.params[name], _unpermute_head_dim(self.header, info),
                         self.columns.get(name))
            _undo_norm_offset(self.header, name, self.params[name])

    def close(self) -> None:
        """Close the file."""
        self._fh.close()

    def __enter__(self) -> "GGUFWeightReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_gguf_weights(path: str | Path, dtype: torch.dtype = torch.float32
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, dequantized tensor) of each of a GGUF's weights in file order, one fresh
    tensor at a time: a model's weights without ever holding them all."""
    header = _read_header(path)
    with open(path, "rb", buffering=0) as fh:
        for info in header.tensors:
            name = hf_name(info.name, header.arch.architecture)
            if name is None:
                continue
            tensor = torch.empty(info.shape, dtype=dtype)
            _copy_tensor(fh, info, tensor, _unpermute_head_dim(header, info))
            _undo_norm_offset(header, name, tensor)
            yield name, tensor


def _undo_norm_offset(header: _GGUFHeader, name: str, tensor: torch.Tensor) -> None:
    """w from the 1 + w a Gemma GGUF stores for a norm weight (name: the HF name)."""
    if header.arch.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
        tensor.sub_(1)


def _unpermute_head_dim(header: _GGUFHeader, info: GGUFTensorInfo) -> Optional[int]:
    """qk_head_dim of a base model's tensor."""
    return qk_head_dim(header.arch, info.name)


def qk_head_dim(arch: ModelArchConfig, gguf_name: str) -> Optional[int]:
    """The head size to undo llama.cpp's Q/K row permutation of tensor gguf_name with, or None:
    convert_hf_to_gguf permutes Q/K (a LoRA adapter's lora_b too) for the llama architecture
    and SmolLM3 (its LlamaModel subclass) only."""
    is_qk = ".attn_q." in gguf_name or ".attn_k." in gguf_name
    permuted = arch.architecture in ("llama", "smollm3")
    return arch.head_dim if permuted and is_qk else None
