"""Parameter counts from checkpoint metadata only: GGUF tensor table, safetensors headers, config;
and which GGUF embedding blocks a dequantized load keeps. What the weights take, by stage, is
the memory planner's (memory/weight_layout.py)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

from gguf import GGMLQuantizationType

from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.loader.errors import read_json_object
from pagedllm.loader.gguf.header import GGUFTensorInfo, gguf_header
from pagedllm.loader.hf.safetensors_header import safetensors_num_params

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
INDEX_FILE = "model.safetensors.index.json"


def gguf_tensors(ckpt: Checkpoint) -> Optional[tuple[GGUFTensorInfo, ...]]:
    """A GGUF's tensor table (None for other checkpoints): a plan reads it once and hands it
    down to what it calls (the `tensors` parameters here and in memory/weight_layout.py)."""
    return gguf_header(ckpt.path)[1] if ckpt.kind == "gguf" else None


def checkpoint_num_params(ckpt: Checkpoint,
                          tensors: Optional[Sequence[GGUFTensorInfo]] = None) -> tuple[int, str]:
    """(parameters, where the number came from), reading no weight data (a GGUF's `tensors`
    as gguf_tensors read them, else read here)."""
    if ckpt.kind == "gguf":
        tensors = gguf_header(ckpt.path)[1] if tensors is None else tensors
        return sum(math.prod(t.shape) for t in tensors), "GGUF tensor table"
    files = sorted(ckpt.path.glob("*.safetensors"))
    if files:
        return sum(safetensors_num_params(f) for f in files), "safetensors headers"
    index = ckpt.path / INDEX_FILE
    if index.is_file():
        metadata = read_json_object(index).get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        itemsize = _DTYPE_BYTES.get(ckpt.arch.torch_dtype or "", 0)
        if isinstance(total, int) and total > 0 and itemsize:
            return int(total) // itemsize, "safetensors index total_size"
    return ckpt.arch.num_params(), "config.json shapes"


def gguf_kept_embedding(ckpt: Checkpoint, kernel_types: frozenset,
                        tensors: Optional[Sequence[GGUFTensorInfo]] = None
                        ) -> Optional[GGMLQuantizationType]:
    """The block format the token embedding of a GGUF keeps when it runs with quantization
    "none", else None. A lookup dequantizes whole rows to the values a dequantized table would
    hold (llama.cpp's get_rows does the same), so keeping its blocks changes only the memory
    (Qwen2.5-0.5B: 0.14 GB in Q8_0 against 0.54 GB in float32). None when the head shares the
    embedding (the head must be float) or its type has no kernels."""
    if ckpt.kind != "gguf" or ckpt.arch.tie_word_embeddings:
        return None
    by_name = {t.name: t for t in (gguf_header(ckpt.path)[1] if tensors is None else tensors)}
    embed = by_name.get("token_embd.weight")
    if embed is None or embed.qtype not in kernel_types or "output.weight" not in by_name:
        return None
    return embed.qtype
