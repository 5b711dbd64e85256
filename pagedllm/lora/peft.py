"""PEFT LoRA adapters: adapter_config.json and adapter_model.safetensors, checked against the
base model's shapes and read into float32 A and B matrices per (layer, projection).

    adapter_model.safetensors
      base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   A [r, in]
      base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   B [out, r]

The delta a module adds is scale * (x @ A^T) @ B^T, scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). What the engine cannot apply is refused by name: modules_to_save, DoRA,
trained biases, per-module ranks, embedding or output-head targets, a rank over max_lora_rank.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from pagedllm.config import ModelArchConfig
from pagedllm.lora.request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight")
_NEUTRAL = {  # config fields the engine does not implement, and the value that means "unused"
    "modules_to_save": (None, []), "use_dora": (False, None), "bias": ("none",),
    "fan_in_fan_out": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
    "lora_bias": (False, None), "layer_replication": (None,),
    "trainable_token_indices": (None,), "target_parameters": (None, []),
    "alora_invocation_tokens": (None,), "use_qalora": (False, None), "use_bdlora": (None, False),
    "arrow_config": (None,), "kasa_config": (None,), "monteclora_config": (None,),
    "velora_config": (None,),
}
_WHY = {
    "modules_to_save": "whole trained copies of base modules are not applied",
    "use_dora": "DoRA's magnitude vectors are not applied",
    "bias": "trained biases are not applied",
    "fan_in_fan_out": "only nn.Linear layouts are read (not GPT-2's Conv1D)",
    "rank_pattern": "every module must share the adapter's r",
    "alpha_pattern": "every module must share the adapter's lora_alpha",
    "lora_bias": "trained biases on lora_B are not applied",
    "layer_replication": "replicated layers are not supported",
    "trainable_token_indices": "trained embedding rows are not applied",
    "target_parameters": "LoRA on bare parameters (experts) is not applied",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not applied",
}
_VARIANT = "a LoRA variant this engine does not apply (plain LoRA and rsLoRA are)"


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine reads from adapter_config.json."""

    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's float32 matrices: (layer index, projection name) -> (A [r, in], B [out, r])."""

    request: LoRARequest
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def base_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection LoRA may target, from the architecture."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def read_adapter_config(path: Path, max_rank: int) -> AdapterConfig:
    """The rank and scale of adapter_config.json; a ValueError naming the field for what the
    engine cannot apply."""
    try:
        raw: dict[str, Any] = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"lora_request.lora_path {str(path)!r}: cannot read {CONFIG_FILE} "
                         f"({err})") from None
    where = f"{path / CONFIG_FILE}"
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type={raw['peft_type']!r} is not supported; only LORA")
    for name, neutral in _NEUTRAL.items():
        if raw.get(name, neutral[0]) not in neutral:
            raise ValueError(f"{where}: {name}={raw[name]!r} is not supported: "
                             f"{_WHY.get(name, _VARIANT)}")
    _check_targets(raw.get("target_modules"), where)
    rank, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be an int >= 1, got {rank!r}")
    check_rank(rank, max_rank, where)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    root = math.sqrt(rank) if raw.get("use_rslora") else rank
    return AdapterConfig(rank, alpha / root)


def _check_targets(targets: Any, where: str) -> None:
    """A list of target_modules may name only the supported projections (a regex string or
    "all-linear" is checked on the tensors instead)."""
    if not isinstance(targets, (list, tuple)):
        return
    other = [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_MODULES]
    if other:
        raise ValueError(f"{where}: target_modules {other} are not supported (embeddings and "
                         f"the output head cannot carry LoRA here); supported: "
                         f"{', '.join(SUPPORTED_MODULES)}")


def _parse_key(key: str, arch: ModelArchConfig, where: str) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a tensor name, or a ValueError naming it."""
    m = _KEY.fullmatch(key)
    if m is None:
        target = ("embeddings or the output head" if "embed" in key or "lm_head" in key
                  else "no supported projection")
        raise ValueError(f"{where}: tensor {key!r} targets {target}; supported: "
                         f"{', '.join(SUPPORTED_MODULES)} of the decoder layers")
    layer, block, module, half = int(m[1]), m[2], m[3], m[4]
    check_target(key, layer, block, module, arch, where)
    return layer, module, half


def check_target(key: str, layer: int, block: str, module: str, arch: ModelArchConfig,
                 where: str) -> None:
    """A ValueError naming tensor `key` unless layer `layer`'s block.module of the base model
    can carry LoRA (block: "self_attn" or "mlp")."""
    allowed = ATTENTION_MODULES if block == "self_attn" else MLP_MODULES
    if module not in allowed:
        raise ValueError(f"{where}: tensor {key!r} targets {block}.{module}; supported: "
                         f"{', '.join(SUPPORTED_MODULES)}")
    if layer >= arch.num_hidden_layers:
        raise ValueError(f"{where}: tensor {key!r} is for layer {layer}, but the base model has "
                         f"{arch.num_hidden_layers} layers")
    if block == "mlp" and arch.moe is not None and arch.is_sparse_layer(layer):
        raise ValueError(f"{where}: tensor {key!r} targets a routed-experts layer, which cannot "
                         "carry LoRA here")


def check_shape(key: str, shape: tuple[int, ...], half: str, module: str, rank: int,
                arch: ModelArchConfig, where: str) -> None:
    """A ValueError naming tensor `key` unless its shape is that of the base model's module's
    A [r, in] (half "A") or B [out, r] (half "B")."""
    out, inp = base_shapes(arch)[module]
    want = (rank, inp) if half == "A" else (out, rank)
    if shape != want:
        raise ValueError(f"{where}: tensor {key!r} has shape {list(shape)}, but the base "
                         f"model's {module} (r={rank}) needs {list(want)}: the adapter was "
                         "trained for another base model")


def check_rank(rank: int, max_rank: int, where: str) -> None:
    """A ValueError unless an adapter's rank fits the engine's slots."""
    if rank > max_rank:
        raise ValueError(f"{where}: r={rank} is over max_lora_rank={max_rank}; start the engine "
                         f"with max_lora_rank >= {rank}")


def _tensor_index(path: Path, arch: ModelArchConfig, cfg: AdapterConfig
                  ) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, projection) -> {"A": key, "B": key}, every shape checked against the base."""
    where = str(path / WEIGHTS_FILE)
    if not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"lora_request.lora_path {str(path)!r} has no {WEIGHTS_FILE} (a .bin "
                         "adapter is not read: save it with safe_serialization)")
    index: dict[tuple[int, str], dict[str, str]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            layer, module, half = _parse_key(key, arch, where)
            check_shape(key, tuple(f.get_slice(key).get_shape()), half, module, cfg.rank, arch,
                        where)
            index.setdefault((layer, module), {})[half] = key
    for (layer, module), halves in index.items():
        if set(halves) != {"A", "B"}:
            missing = "lora_B" if "A" in halves else "lora_A"
            raise ValueError(f"{where}: layer {layer}'s {module} has no {missing} tensor")
    if not index:
        raise ValueError(f"{where} holds no LoRA tensors")
    return index


def check_adapter(request: LoRARequest, arch: ModelArchConfig, max_rank: int,
                  ) -> AdapterConfig:
    """Read the adapter's config and tensor headers (no weights) and refuse, naming the field
    or the tensor, what this engine cannot apply to this base model."""
    path = Path(request.lora_path)
    if not path.is_dir():
        raise ValueError(f"lora_request.lora_path {request.lora_path!r} is not a local "
                         "directory (a PEFT adapter's: adapter_config.json and "
                         "adapter_model.safetensors) or a llama.cpp LoRA adapter's .gguf file")
    cfg = read_adapter_config(path, max_rank)
    _tensor_index(path, arch, cfg)
    return cfg


def load_adapter(request: LoRARequest, arch: ModelArchConfig, max_rank: int,
                 device: Optional[torch.device] = None) -> LoRAAdapter:
    """The adapter's checked float32 matrices."""
    path = Path(request.lora_path)
    cfg = read_adapter_config(path, max_rank)
    index = _tensor_index(path, arch, cfg)
    weights = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for target, keys in index.items():
            weights[target] = tuple(f.get_tensor(keys[h]).to(device or "cpu", torch.float32)
                                    for h in ("A", "B"))
    return LoRAAdapter(request, cfg, weights)
