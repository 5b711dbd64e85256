"""int8/int4 of a float checkpoint are made while loading, slice by slice (loader/row_encoding.py):
the blocks equal quantizing the whole float matrix, and the float model never exists whole."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedllm.layers.quantization import quantize_q4_1, quantize_q8_0, quantize_q8_0g4
from pagedllm.loader.hf import safetensors_loader
from pagedllm.loader.row_encoding import EncodedRows
from pagedllm.shard import Shard

ROOT = Path(__file__).resolve().parents[2]
NAME = "model.layers.0.mlp.down_proj.weight"  # SmolLM2: [576, 1536], the reduction axis split by TP


def _tensor(hf_dir: Path, name: str) -> torch.Tensor:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(hf_dir / index[name]), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("encode, row_bytes",
                         [(quantize_q8_0, 34), (quantize_q8_0g4, 34), (quantize_q4_1, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_load_equals_quantizing_the_whole(smollm_hf_dir, monkeypatch, encode, row_bytes,
                                                 dtype):
    """The loader's row-sliced copy (forced into many uneven slices) into EncodedRows writes the
    very bytes of quantizing the whole matrix in the model's dtype; so does a TP rank's column
    shard."""
    monkeypatch.setattr(safetensors_loader, "CHUNK_ELEMENTS", 1536 * 37)  # 37 rows a slice
    whole = _tensor(smollm_hf_dir, NAME)
    rows, cols = whole.shape
    blocks = torch.zeros(rows, cols // 32 * row_bytes, dtype=torch.uint8)
    safetensors_loader.load_safetensors_weights(
        smollm_hf_dir, {NAME: EncodedRows(blocks, cols, dtype, encode)},
        skip=lambda name: name != NAME)
    assert torch.equal(blocks, encode(whole.to(dtype)))

    half = cols // 2  # rank 1 of 2: the second half of every row
    shard = torch.zeros(rows, half // 32 * row_bytes, dtype=torch.uint8)
    safetensors_loader.load_safetensors_weights(
        smollm_hf_dir, {NAME: EncodedRows(shard, half, dtype, encode)},
        skip=lambda name: name != NAME, shards={NAME: Shard(1, half, half, cols)})
    assert torch.equal(shard, encode(whole[:, half:].to(dtype)))


def test_rows_of_another_shape_are_refused():
    rows = EncodedRows(torch.zeros(4, 34, dtype=torch.uint8), 32, torch.float32, quantize_q8_0)
    assert rows.shape == (4, 32) and rows.numel() == 128 and rows[1:3].shape == (2, 32)
    with pytest.raises(ValueError, match=r"rows of shape \(4, 64\) do not fit block rows of shape \(4, 32\)"):
        rows.copy_(torch.zeros(4, 64))
    with pytest.raises(TypeError, match="row slices only"):
        rows[0]


PEAK = """
import json, resource, sys
import torch
from pagedllm import LLM

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts here
before = rss()
llm = LLM(model=sys.argv[1], dtype="float32", quantization=sys.argv[2], max_model_len=256,
          kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16)
print(json.dumps({"above": hwm() - before}))
"""


def _load_peak(hf_dir: Path, quantization: str) -> int:
    done = subprocess.run([sys.executable, "-c", PEAK, str(hf_dir), quantization],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["above"]


def test_int8_load_peaks_below_a_float_load(smollm_hf_dir):
    """In fresh processes, the engine's start with int8 peaks lower than with the float32
    weights it is made from: quantizing a loaded float model held the float model and its
    blocks at once (peak above a float load's by the blocks, 173 MB here)."""
    as_float, as_int8 = _load_peak(smollm_hf_dir, "none"), _load_peak(smollm_hf_dir, "int8")
    print(f"start's peak above the imports: float32 {as_float / 1e6:.0f} MB, "
          f"int8 {as_int8 / 1e6:.0f} MB")
    assert as_int8 < as_float, (as_int8, as_float)
