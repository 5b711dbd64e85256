"""GGUF metadata and tensors of the newer families: what is read, what is refused by name."""
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.rope import LONG, SHORT
from pagedllm.loader.gguf.weights import arch_from_gguf, gguf_quant_plan, hf_name, load_gguf_weights


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray], hidden: int = 8,
           **fields) -> Path:
    """A GGUF of a 1-layer model (2 heads) with extra `<arch>.*` fields and tensors (a uint8
    tensor is Q8_0 blocks)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in fields.items():
        key = f"{arch}.{key.replace('__', '.')}"
        adders = {float: writer.add_float32, str: writer.add_string}
        adders.get(type(value), writer.add_uint32)(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, hidden), dtype=np.float32))
    for name, value in tensors.items():
        qtype = gguf.GGMLQuantizationType.Q8_0 if value.dtype == np.uint8 else None
        writer.add_tensor(name, value, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_phi3_reads_its_factor_tensors_and_window(tmp_path):
    long, short = np.array([2.0, 3.0], np.float32), np.array([1.0, 1.5], np.float32)
    path = _write(tmp_path / "p.gguf", "phi3", {"rope_factors_long.weight": long,
                                                "rope_factors_short.weight": short},
                  rope__scaling__original_context_length=16, rope__scaling__attn_factor=1.2,
                  attention__sliding_window=32, rope__dimension_count=4)
    arch = arch_from_gguf(path)
    assert (arch.architecture, arch.sliding_window) == ("phi3", 32)
    assert arch.layer_window(0) == 32  # every Phi-3 layer slides, as llama.cpp runs it
    assert arch.rope_scaling == {"rope_type": "longrope", "long_factor": [2.0, 3.0],
                                 "short_factor": [1.0, 1.5],
                                 "original_max_position_embeddings": 16,
                                 "attention_factor": pytest.approx(1.2)}
    # llama.cpp writes sliding_window 0 for none
    none = _write(tmp_path / "n.gguf", "phi3", {}, attention__sliding_window=0)
    assert arch_from_gguf(none).sliding_window is None


def test_half_a_longrope_or_an_odd_rotary_dim_is_refused(tmp_path):
    one = _write(tmp_path / "one.gguf", "phi3", {LONG: np.ones(2, np.float32)},
                 rope__scaling__original_context_length=16)
    with pytest.raises(ModelFileError, match="without rope_factors_short.weight"):
        arch_from_gguf(one)
    three = np.ones(3, np.float32)
    short = _write(tmp_path / "short.gguf", "phi3", {LONG: three, SHORT: three},
                   rope__scaling__original_context_length=16)
    with pytest.raises(ModelFileError, match="has 3 values, want one per rotated pair \\(2\\)"):
        arch_from_gguf(short)
    odd = _write(tmp_path / "odd.gguf", "phi3", {}, rope__dimension_count=3)
    with pytest.raises(ModelFileError, match=r"rotary_dim must be even .*\(4\), got 3"):
        arch_from_gguf(odd)


def test_a_partial_rotary_gguf_sizes_its_factors_by_the_rotated_values(tmp_path):
    one = np.ones(1, np.float32)
    path = _write(tmp_path / "p.gguf", "phi3", {LONG: one, SHORT: one},
                  rope__dimension_count=2, rope__scaling__original_context_length=16)
    arch = arch_from_gguf(path)
    assert (arch.head_dim, arch.rotary_dim) == (4, 2)
    assert arch.rope_scaling["long_factor"] == [1.0]


def test_fused_phi3_tensors_split_by_rows_into_the_shards(tmp_path):
    qkv = np.arange(24 * 8, dtype=np.float32).reshape(24, 8)  # q 8 rows, k 8, v 8
    gate_up = -np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
    path = _write(tmp_path / "f.gguf", "phi3", {"blk.0.attn_qkv.weight": qkv,
                                                "blk.0.ffn_up.weight": gate_up})
    assert hf_name("blk.0.ffn_up.weight", "phi3") == "model.layers.0.mlp.gate_up_proj.weight"
    assert hf_name("blk.0.ffn_up.weight") == "model.layers.0.mlp.up_proj.weight"  # llama's
    layer = "model.layers.0."
    params = {"model.embed_tokens.weight": torch.empty(4, 8)}
    for shard, rows in (("self_attn.q_proj", 8), ("self_attn.k_proj", 8), ("self_attn.v_proj", 8),
                        ("mlp.gate_proj", 16), ("mlp.up_proj", 16)):
        params[f"{layer}{shard}.weight"] = torch.empty(rows, 8)
    load_gguf_weights(path, params)
    assert torch.equal(params[f"{layer}self_attn.k_proj.weight"], torch.from_numpy(qkv[8:16]))
    assert torch.equal(params[f"{layer}mlp.up_proj.weight"], torch.from_numpy(gate_up[16:]))
    params[f"{layer}self_attn.v_proj.weight"] = torch.empty(4, 8)
    with pytest.raises(ValueError, match="has shape \\(24, 8\\) but its shards .* 20 rows"):
        load_gguf_weights(path, params)


def test_a_fused_block_tensor_plans_every_shard_in_its_format(tmp_path):
    blocks = gguf.quants.quantize(np.random.default_rng(0).standard_normal((24, 32), np.float32),
                                  gguf.GGMLQuantizationType.Q8_0)
    path = _write(tmp_path / "q.gguf", "phi3", {"blk.0.attn_qkv.weight": blocks}, hidden=32)
    plan = gguf_quant_plan(path, frozenset({gguf.GGMLQuantizationType.Q8_0}))
    assert plan == {f"model.layers.0.self_attn.{s}": gguf.GGMLQuantizationType.Q8_0
                    for s in ("q_proj", "k_proj", "v_proj")}


def test_llama3_rope_freqs_become_frequency_divisors(tmp_path):
    divisors = np.array([1.0, 8.0], np.float32)
    path = _write(tmp_path / "l.gguf", "llama", {"rope_freqs.weight": divisors})
    assert arch_from_gguf(path).rope_scaling == {"rope_type": "frequency_divisors",
                                                 "divisors": [1.0, 8.0]}
    both = _write(tmp_path / "both.gguf", "llama", {"rope_freqs.weight": np.ones(2, np.float32)},
                  rope__scaling__type="linear", rope__scaling__factor=2.0)
    with pytest.raises(ModelFileError, match="both llama.rope.scaling.\\* metadata and the tensor "
                       "rope_freqs.weight"):
        arch_from_gguf(both)
