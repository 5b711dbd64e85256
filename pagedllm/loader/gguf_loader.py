"""Read a GGUF file: its architecture metadata, and its tensors dequantized into HF-named params."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm.config import ModelArchConfig
from pagedllm.loader.progress import load_progress

# GGUF general.architecture -> registry key (llama.cpp stores Mistral as "llama").
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2"}

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
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Precomputed Llama-3 rope frequencies: derived data, not a parameter (transformers skips it too).
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is encoded."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: [rows, cols] (GGUF lists dims innermost first)
    offset: int  # absolute byte offset of the payload in the file
    nbytes: int


# GGUF value type id -> struct format of a scalar (8: string, 9: array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _HeaderReader:
    """Sequential little-endian reads of a GGUF header, from a buffer filled from the file in
    large reads (a 150k vocabulary is ~300k strings to hop over; one read and seek per string
    took ~1.1 s of every start-up, walking a buffer takes ~0.1 s)."""

    _CHUNK = 1 << 22

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.buf = b""
        self.pos = 0

    def _need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        more = self.fh.read(max(n, self._CHUNK))
        self.buf = self.buf[self.pos:] + more
        self.pos = 0
        if len(self.buf) < n:
            raise ValueError("GGUF header is truncated")

    def scalar(self, fmt: str) -> Any:
        """One struct-packed value."""
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        self._need(n)
        self.pos += n

    def string(self) -> str:
        """A u64-length-prefixed UTF-8 string."""
        n = self.scalar("<Q")
        self._need(n)
        text = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def tell(self) -> int:
        """Offset in the file of the next byte to read."""
        return self.fh.tell() - (len(self.buf) - self.pos)

    def value(self, vtype: int) -> Any:
        """A metadata value; arrays are skipped (returned as None): loading never needs them."""
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"GGUF metadata has unknown value type {vtype}")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALAR_FORMATS:
            self.skip(count * struct.calcsize(_SCALAR_FORMATS[etype]))
        elif etype == _STRING:  # token lists and merges: hop over each string
            unpack = struct.Struct("<Q").unpack_from
            buf, pos = self.buf, self.pos
            for _ in range(count):
                if pos + 8 <= len(buf):
                    end = pos + 8 + unpack(buf, pos)[0]
                    if end <= len(buf):
                        pos = end
                        continue
                self.pos = pos  # the string runs past the buffer: read it the slow way
                self.skip(self.scalar("<Q"))
                buf, pos = self.buf, self.pos
            self.pos = pos
        else:  # nested arrays
            for _ in range(count):
                self.value(etype)
        return None


def read_gguf_header(fh: BinaryIO) -> tuple[dict[str, Any], tuple[GGUFTensorInfo, ...]]:
    """(scalar/string metadata, tensor table) of a GGUF v2/v3 file, reading no tensor data.

    GGUFReader would do this too, but it materialises every token string as a numpy view
    (about 9 s for a 150k vocabulary); walking the header directly takes well under a second.
    """
    r = _HeaderReader(fh)
    if r.scalar("<I") != GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version = r.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        fields[key] = r.value(r.scalar("<I"))
    raw = []
    for _ in range(n_tensors):
        name = r.string()
        dims = tuple(r.scalar("<Q") for _ in range(r.scalar("<I")))
        raw.append((name, dims, GGMLQuantizationType(r.scalar("<I")), r.scalar("<Q")))
    align = int(fields.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-r.tell() // align) * align
    tensors = []
    for name, dims, qtype, rel in raw:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims, dtype=np.int64))
        tensors.append(GGUFTensorInfo(name=name, qtype=qtype, shape=tuple(reversed(dims)),
                                      offset=data_start + rel, nbytes=n_elements // block * type_size))
    return fields, tuple(tensors)


def gguf_header(path: str | Path) -> tuple[dict[str, Any], tuple[GGUFTensorInfo, ...]]:
    """read_gguf_header of a file, parsed once per process (keyed by path, size and mtime);
    the metadata dict is shared: read it, do not change it."""
    st = os.stat(path)
    return _cached_header(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _cached_header(path: str, size: int, mtime_ns: int
                   ) -> tuple[dict[str, Any], tuple[GGUFTensorInfo, ...]]:
    with open(path, "rb") as fh:
        return read_gguf_header(fh)


@dataclass(frozen=True)
class _GGUFHeader:
    """Everything loading needs from a GGUF, without its tensor payloads."""

    arch: ModelArchConfig
    tensors: tuple[GGUFTensorInfo, ...]


def hf_name(gguf_name: str) -> Optional[str]:
    """HF parameter name for a GGUF tensor name, or None if it has no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _required(fields: Mapping[str, Any], key: str) -> Any:
    """Metadata value, or a ValueError naming the missing key."""
    if fields.get(key) is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return fields[key]


def _rope_scaling(fields: Mapping[str, Any], prefix: str) -> Optional[dict[str, Any]]:
    """HF-style rope_scaling dict from `<arch>.rope.scaling.*` (or legacy scale_linear) keys."""
    kind = fields.get(f"{prefix}.rope.scaling.type")
    factor = fields.get(f"{prefix}.rope.scaling.factor")
    if kind is None and (linear := fields.get(f"{prefix}.rope.scale_linear")) is not None:
        kind, factor = "linear", linear
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    original = fields.get(f"{prefix}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = fields.get(f"{prefix}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def _eos_ids(fields: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids: eos, then end-of-turn / end-of-message if the GGUF names them."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _arch(fields: Mapping[str, Any], tensors: tuple[GGUFTensorInfo, ...]) -> ModelArchConfig:
    """ModelArchConfig from the `<arch>.*` keys and the tensor list."""
    gguf_arch = _required(fields, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"general.architecture={gguf_arch!r} is not supported; "
                         f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    names = {t.name: t for t in tensors}
    if "token_embd.weight" not in names:
        raise ValueError("GGUF has no tensor 'token_embd.weight'")
    p = gguf_arch
    hidden = int(_required(fields, f"{p}.embedding_length"))
    heads = int(_required(fields, f"{p}.attention.head_count"))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch],
        vocab_size=names["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(_required(fields, f"{p}.feed_forward_length")),
        num_hidden_layers=int(_required(fields, f"{p}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(fields.get(f"{p}.attention.head_count_kv") or heads),
        head_dim=int(fields.get(f"{p}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(_required(fields, f"{p}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{p}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_required(fields, f"{p}.context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=_rope_scaling(fields, p),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(fields),
        torch_dtype=None,  # quantized: no single checkpoint dtype
    )


def _read_header(path: str | Path) -> _GGUFHeader:
    """Parse metadata and tensor table, without touching tensor payloads."""
    fields, tensors = gguf_header(path)
    return _GGUFHeader(arch=_arch(fields, tensors), tensors=tensors)


def arch_from_gguf(path: str | Path) -> ModelArchConfig:
    """ModelArchConfig from a GGUF file's metadata."""
    return _read_header(path).arch


def gguf_quant_plan(path: str | Path, kernel_types: frozenset) -> dict[str, GGMLQuantizationType]:
    """Module name -> block format, for each 2-D weight whose GGUF type is in kernel_types."""
    header = _read_header(path)
    plan: dict[str, GGMLQuantizationType] = {}
    for info in header.tensors:
        name = hf_name(info.name)
        if name and name.endswith(".weight") and len(info.shape) == 2 and info.qtype in kernel_types:
            plan[name.removesuffix(".weight")] = info.qtype
    if header.arch.tie_word_embeddings and "model.embed_tokens" in plan:
        plan["lm_head"] = plan["model.embed_tokens"]  # the head shares the embedding's blocks
    return plan


def _read_bytes(fh: BinaryIO, offset: int, nbytes: int) -> np.ndarray:
    """nbytes at offset as a fresh uint8 array (plain reads: no mmap pages stay resident)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    fh.seek(offset)
    got = 0
    while got < nbytes:
        n = fh.readinto(view[got:])
        if not n:
            raise ValueError(f"GGUF file ends inside a tensor at byte {offset + got}")
        got += n
    return buf


def _unpermute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> HF rotate_half) on whole heads."""
    # Within each head llama.cpp stores rows as [d0, d_half, d1, d_half+1, ...].
    n_heads = rows.shape[0] // head_dim
    return rows.reshape(n_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _copy_tensor(fh: BinaryIO, info: GGUFTensorInfo, dest: torch.Tensor,
                 head_dim: Optional[int]) -> None:
    """Dequantize one tensor into dest in row chunks (a uint8 dest takes the blocks as they are);
    head_dim set means un-permute Q/K rows."""
    # 1-D norms and biases are small: one row.
    rows, cols = (1, info.shape[0]) if len(info.shape) == 1 else info.shape
    row_bytes = info.nbytes // rows
    if dest.dtype == torch.uint8:
        cols = row_bytes
    step = max(1, CHUNK_ELEMENTS // cols)
    if head_dim is not None:
        step = max(head_dim, step // head_dim * head_dim)  # a head's rows must stay together
    flat = dest.view(rows, cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        raw = _read_bytes(fh, info.offset + r0 * row_bytes, n * row_bytes).reshape(n, row_bytes)
        # [n, cols]: float32 values, or the blocks themselves for a block-format destination
        chunk = raw if dest.dtype == torch.uint8 else dequantize(raw, info.qtype).reshape(n, cols)
        if head_dim is not None:
            chunk = _unpermute(chunk.reshape(-1, 1) if len(info.shape) == 1 else chunk, head_dim)
            chunk = chunk.reshape(n, cols)
        flat[r0:r0 + n].copy_(torch.from_numpy(chunk))


def _check_shape(name: str, dest: torch.Tensor, info: GGUFTensorInfo) -> None:
    """ValueError naming both tensors unless dest has the GGUF tensor's (torch-order) shape
    (for a uint8 block-format destination: [rows, bytes per row])."""
    want = info.shape
    if dest.dtype == torch.uint8 and len(info.shape) == 2:
        want = (info.shape[0], info.nbytes // info.shape[0])
    if tuple(dest.shape) != want:
        raise ValueError(f"{name!r} has shape {tuple(dest.shape)} but GGUF tensor "
                         f"{info.name!r} has shape {info.shape}")


def _plan(header: _GGUFHeader, params: Mapping[str, torch.Tensor]) -> list[tuple[GGUFTensorInfo, str]]:
    """(source tensor, destination name) pairs covering every param exactly once."""
    plan: list[tuple[GGUFTensorInfo, str]] = []
    embed: Optional[GGUFTensorInfo] = None
    for info in header.tensors:
        name = hf_name(info.name)
        if name is None:
            if info.name in _IGNORED_TENSORS:
                continue
            raise ValueError(f"unexpected GGUF tensor {info.name!r} (no HF parameter for it)")
        if name not in params:
            raise ValueError(f"unexpected GGUF tensor {info.name!r}: the model has no {name!r}")
        _check_shape(name, params[name], info)
        embed = info if info.name == "token_embd.weight" else embed
        plan.append((info, name))
    filled = {name for _, name in plan}
    if "lm_head.weight" in params and "lm_head.weight" not in filled and embed is not None:
        _check_shape("lm_head.weight", params["lm_head.weight"], embed)
        plan.append((embed, "lm_head.weight"))  # untied model, tied checkpoint
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"GGUF has no tensor for parameters: {', '.join(missing)}")
    return plan


def load_gguf_weights(path: str | Path, params: Mapping[str, torch.Tensor]) -> None:
    """Fill pre-allocated float tensors (HF names) from a GGUF, streaming one chunk at a time."""
    header = _read_header(path)
    for name, tensor in params.items():
        kind_ok = tensor.is_floating_point() or tensor.dtype == torch.uint8
        if not kind_ok or not tensor.is_contiguous():
            raise ValueError(f"destination {name!r} must be a contiguous float or uint8 (block "
                             f"format) tensor (dtype {tensor.dtype}, "
                             f"contiguous={tensor.is_contiguous()})")
    plan = _plan(header, params)
    permuted = header.arch.architecture == "llama"  # convert_hf_to_gguf permutes Q/K for llama only
    with open(path, "rb", buffering=0) as fh:
        for info, name in load_progress(plan, path):
            is_qk = ".attn_q." in info.name or ".attn_k." in info.name
            with torch.no_grad():
                _copy_tensor(fh, info, params[name], header.arch.head_dim if permuted and is_qk else None)
