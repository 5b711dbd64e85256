"""llama.cpp's GGUF LoRA adapters (as convert_lora_to_gguf.py writes them), read into the same
checked float32 A and B a PEFT directory gives.

    general.type = "adapter"   adapter.type = "lora"   adapter.lora.alpha (f32)
    general.architecture       llama.cpp's name of the base's family (Mistral is "llama")
    blk.N.attn_q.weight.lora_a   dims [in, r]    torch [r, in]    A
    blk.N.attn_q.weight.lora_b   dims [r, out]   torch [out, r]   B

The scale is alpha / r, as llama.cpp applies it (llama_adapter_lora_weight::get_scale; alpha 0
means a scale of 1). The converter keeps no trace of peft's use_rslora: llama.cpp scales such an
adapter by alpha / r too, and so does this. For the llama architecture (and SmolLM3) the
converter permutes the rows of attn_q's and attn_k's lora_b as it does the base weights; they
are put back in Hugging Face's order, as the base's are. Tensors are F32, F16, BF16 or Q8_0
(the converter's --outtype; with q8_0 a lora_b whose rank is not a multiple of 32 stays F16).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm.config import ModelArchConfig
from pagedllm.loader.gguf.arch import GGUF_ARCHITECTURES
from pagedllm.loader.gguf.header import GGUFTensorInfo, parse_gguf_file
from pagedllm.loader.gguf.weights import hf_name, qk_head_dim, unpermute_qk_rows
from pagedllm.lora.peft import (SUPPORTED_MODULES, AdapterConfig, LoRAAdapter, check_rank,
                                check_shape, check_target)
from pagedllm.lora.request import LoRARequest

READ_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
              GGMLQuantizationType.Q8_0)
_HALVES = {".lora_a": "A", ".lora_b": "B"}
_HF = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight")
_ALORA = "adapter.alora.invocation_tokens"
Pairs = dict[tuple[int, str], dict[str, GGUFTensorInfo]]  # (layer, projection) -> A and B


def _header(path: Path) -> tuple[Mapping[str, Any], tuple[GGUFTensorInfo, ...]]:
    if not path.is_file():
        raise ValueError(f"lora_request.lora_path {str(path)!r} is not a file (a llama.cpp LoRA "
                         "adapter's .gguf)")
    try:
        return parse_gguf_file(path)
    except ValueError as err:
        raise ValueError(f"lora_request.lora_path: {err}") from None


def _check_fields(fields: Mapping[str, Any], arch: ModelArchConfig, where: str) -> float:
    """adapter.lora.alpha, once the file is known to be a LoRA adapter for this base's family."""
    kind = fields.get("general.type")
    if kind != "adapter":
        raise ValueError(f"{where}: general.type={kind!r}: not a LoRA adapter (a model file?); "
                         "llama.cpp's adapters have general.type='adapter'")
    if fields.get("adapter.type") != "lora":
        raise ValueError(f"{where}: adapter.type={fields.get('adapter.type')!r} is not "
                         "supported; only 'lora'")
    family = fields.get("general.architecture")
    if GGUF_ARCHITECTURES.get(family) != arch.architecture:
        raise ValueError(f"{where}: general.architecture={family!r}: the adapter is for another "
                         f"architecture than the base model's ({arch.architecture!r})")
    if _ALORA in fields:
        raise ValueError(f"{where}: {_ALORA} is not supported: activated LoRA (aLoRA) is not "
                         "applied")
    alpha = fields.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: adapter.lora.alpha must be a number, got {alpha!r}")
    return float(alpha)


def _target(info: GGUFTensorInfo, arch: ModelArchConfig, where: str) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of an adapter tensor, or a ValueError naming it."""
    name = info.name
    half = next((h for suffix, h in _HALVES.items() if name.endswith(suffix)), None)
    base = name[:-len(".lora_a")] if half else name
    hf = hf_name(base, arch.architecture) or ""
    m = _HF.fullmatch(hf)
    if half is None:
        what = ("a norm weight (mergekit's), which is not applied" if "norm" in name
                else "not a .lora_a or .lora_b tensor")
        raise ValueError(f"{where}: tensor {name!r} is {what}")
    if m is None:
        target = ("embeddings or the output head" if base in ("token_embd.weight", "output.weight")
                  else "no supported projection")
        raise ValueError(f"{where}: tensor {name!r} targets {target}; supported: the "
                         f"{', '.join(SUPPORTED_MODULES)} of the decoder layers")
    check_target(name, int(m[1]), m[2], m[3], arch, where)
    if info.qtype not in READ_TYPES:
        raise ValueError(f"{where}: tensor {name!r} is {info.qtype.name}; LoRA tensors are read "
                         f"as {', '.join(t.name for t in READ_TYPES)}")
    return int(m[1]), m[3], half


def _pairs(tensors: tuple[GGUFTensorInfo, ...], arch: ModelArchConfig, max_rank: int,
           where: str) -> tuple[Pairs, int]:
    """Every projection's A and B, checked against the base's shapes, and the adapter's rank."""
    pairs: Pairs = {}
    for info in tensors:
        layer, module, half = _target(info, arch, where)
        pairs.setdefault((layer, module), {})[half] = info
    if not pairs:
        raise ValueError(f"{where} holds no LoRA tensors")
    rank: Optional[int] = None
    for (layer, module), halves in sorted(pairs.items()):
        if set(halves) != {"A", "B"}:
            missing = "lora_b" if "A" in halves else "lora_a"
            raise ValueError(f"{where}: layer {layer}'s {module} has no {missing} tensor")
        rank = halves["A"].shape[0] if rank is None else rank
        check_rank(rank, max_rank, where)
        if halves["A"].shape[0] != rank:
            raise ValueError(f"{where}: tensor {halves['A'].name!r} has rank "
                             f"{halves['A'].shape[0]}, others {rank}: every module must share "
                             "the adapter's r (its scale is alpha / r)")
        for half, info in halves.items():
            check_shape(info.name, info.shape, half, module, rank, arch, where)
    assert rank is not None
    return pairs, rank


def _config(path: Path, arch: ModelArchConfig, max_rank: int
            ) -> tuple[AdapterConfig, Pairs]:
    fields, tensors = _header(path)
    where = str(path)
    alpha = _check_fields(fields, arch, where)
    pairs, rank = _pairs(tensors, arch, max_rank, where)
    return AdapterConfig(rank, alpha / rank if alpha else 1.0), pairs


def check_gguf_adapter(request: LoRARequest, arch: ModelArchConfig, max_rank: int
                       ) -> AdapterConfig:
    """Read the adapter's header (no tensor data) and refuse, naming the key or the tensor,
    what this engine cannot apply to this base model."""
    return _config(Path(request.lora_path), arch, max_rank)[0]


def _read(fh: Any, info: GGUFTensorInfo, arch: ModelArchConfig) -> torch.Tensor:
    fh.seek(info.offset)
    raw = np.frombuffer(bytearray(fh.read(info.nbytes)), dtype=np.uint8)
    values = dequantize(raw, info.qtype).astype(np.float32, copy=False).reshape(info.shape)
    head_dim = qk_head_dim(arch, info.name)
    if head_dim is not None and info.name.endswith(".lora_b"):
        values = unpermute_qk_rows(values, head_dim)
    return torch.from_numpy(np.ascontiguousarray(values))


def load_gguf_adapter(request: LoRARequest, arch: ModelArchConfig, max_rank: int,
                      device: Optional[torch.device] = None) -> LoRAAdapter:
    """The adapter's checked float32 matrices."""
    path = Path(request.lora_path)
    cfg, pairs = _config(path, arch, max_rank)
    weights = {}
    with open(path, "rb") as fh:
        for target, halves in pairs.items():
            weights[target] = tuple(_read(fh, halves[h], arch).to(device or "cpu")
                                    for h in ("A", "B"))
    return LoRAAdapter(request, cfg, weights)
