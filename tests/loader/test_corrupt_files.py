"""Corrupt, truncated and hostile model files are refused with one ModelFileError naming the file.

The GGUF cases are SmolLM2's real file, cut or with one field overwritten; the copies are
sparse where they keep the real file's size, so each case writes only its first few MiB.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM
from pagedllm.loader.checkpoint import Checkpoint, load_weights, resolve_checkpoint
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.gguf.header import gguf_header
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.tokenizer.tokenizer import load_tokenizer
from pagedllm.loader.weight_checks import check_finite_vectors

HEAD_BYTES = 3_000_000  # SmolLM2's header is 1.79 MB; its first tensor starts right after it
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def smollm_head(smollm_gguf) -> bytes:
    """The first HEAD_BYTES of SmolLM2's GGUF: its whole header and the start of its data."""
    with open(smollm_gguf, "rb") as fh:
        return fh.read(HEAD_BYTES)


def _gguf(tmp_path: Path, data: bytes, size: int | None = None, name: str = "model.gguf") -> Path:
    """data in a .gguf file, extended (sparse, zeros) to size bytes if given."""
    path = tmp_path / name
    path.write_bytes(data)
    if size is not None:
        os.truncate(path, size)
    return path


def _refused(path: Path, match: str, call=resolve_checkpoint) -> str:
    """The one-line ModelFileError that call(path) raises; it names the file."""
    with pytest.raises(ModelFileError, match=match) as info:
        call(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    return message


def _value_at(head: bytes, key: str, type_id: int) -> int:
    """Offset of the value of metadata key (stored with GGUF type type_id) in the header."""
    tag = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", type_id)
    return head.index(tag) + len(tag)


def _patched(head: bytes, offset: int, packed: bytes) -> bytes:
    return head[:offset] + packed + head[offset + len(packed):]


@pytest.mark.parametrize("cut, match", [
    (0, "empty"),
    (3, "not a GGUF file"),
    (20, "ends inside the GGUF preamble"),
    (1_000, "claims 272 tensors and 33 metadata keys"),  # inside the metadata
    (1_780_000, "ends inside tensor info #176"),  # inside the tensor table
    (HEAD_BYTES, r"tensor 'token_embd.weight' needs bytes .* \(and 271 more tensors\)"),  # data
])
def test_a_gguf_cut_anywhere_is_refused(tmp_path, smollm_head, cut, match):
    _refused(_gguf(tmp_path, smollm_head[:cut]), match)


def test_random_bytes_are_not_a_gguf(tmp_path):
    _refused(_gguf(tmp_path, os.urandom(4096)), "not a GGUF file")


@pytest.mark.parametrize("offset, packed, match", [
    (16, struct.pack("<Q", 2**40), "1099511627776 metadata keys"),  # n_kv (was an OverflowError)
    (8, struct.pack("<Q", 2**40), "1099511627776 tensors"),  # n_tensors
    (8, struct.pack("<Q", 98_362_432 // 32), "more than the .* bytes left"),  # one per 32 bytes
    (24, struct.pack("<Q", 2**62), "a key of 4611686018427387904 bytes"),  # was a MemoryError
    (4, struct.pack("<I", 4), "GGUF version 4 is not supported"),
], ids=["n_kv", "n_tensors", "n_tensors_just_too_many", "key_length", "version"])
def test_absurd_counts_and_lengths_are_refused_before_allocating(tmp_path, smollm_gguf,
                                                                  smollm_head, offset, packed, match):
    size = smollm_gguf.stat().st_size  # the real size: the counts are checked against it
    _refused(_gguf(tmp_path, _patched(smollm_head, offset, packed), size), match)


def test_absurd_string_and_array_lengths_in_values(tmp_path, smollm_gguf, smollm_head):
    size = smollm_gguf.stat().st_size
    at = _value_at(smollm_head, "general.architecture", 8)  # the string's length prefix
    _refused(_gguf(tmp_path, _patched(smollm_head, at, struct.pack("<Q", 2**62)), size),
             r"ends inside the value of metadata key 'general.architecture' \(it needs "
             "4611686018427387904 bytes")
    at = _value_at(smollm_head, "tokenizer.ggml.tokens", 9) + 4  # the array's element count
    _refused(_gguf(tmp_path, _patched(smollm_head, at, struct.pack("<Q", 2**61)), size),
             "'tokenizer.ggml.tokens': array length 2305843009213693952 cannot fit")


def _tensor_info_at(head: bytes, name: str) -> int:
    """Offset of n_dims in the tensor info of tensor name."""
    tag = struct.pack("<Q", len(name)) + name.encode()
    return head.index(tag) + len(tag)


def test_a_tensor_table_that_lies_is_refused(tmp_path, smollm_gguf, smollm_head):
    size = smollm_gguf.stat().st_size
    at = _tensor_info_at(smollm_head, "token_embd.weight")  # n_dims u32, dims u64 x 2, type, offset
    cases = [
        (at + 4, struct.pack("<Q", 2**40), r"'token_embd.weight' needs bytes"),  # past the end
        (at + 4, struct.pack("<Q", 0), r"shape \(0, 49152\): every dimension must be >= 1"),
        (at + 4, struct.pack("<Q", 33), "rows of 33 values, not a multiple of Q8_0's block of 32"),
        (at, struct.pack("<I", 9), "has 9 dimensions"),
        (at + 20, struct.pack("<I", 1000), "unknown ggml type 1000"),
        (at + 24, struct.pack("<Q", 7), "data offset 7, not a multiple of the alignment 32"),
    ]
    renamed = _tensor_info_at(smollm_head, "blk.1.attn_k.weight") - 19
    cases.append((renamed, b"blk.0.attn_k.weight", "'blk.0.attn_k.weight' appears twice"))
    for offset, packed, match in cases:
        _refused(_gguf(tmp_path, _patched(smollm_head, offset, packed), size), match)


@pytest.mark.parametrize("key, type_id, packed, match", [
    ("llama.attention.head_count", 4, struct.pack("<I", 0),
     "llama.attention.head_count must be >= 1 and <= 2147483647, got 0"),  # was ZeroDivisionError
    ("llama.attention.head_count_kv", 4, struct.pack("<I", 0), "head_count_kv must be >= 1"),
    ("llama.attention.head_count_kv", 4, struct.pack("<I", 4),
     r"num_attention_heads \(9\) must be a multiple of num_key_value_heads \(4\)"),
    ("llama.embedding_length", 4, struct.pack("<I", 0), "llama.embedding_length must be >= 1"),
    ("llama.embedding_length", 4, struct.pack("<I", 2**32 - 1), "got 4294967295"),
    ("llama.embedding_length", 4, struct.pack("<I", 512),
     r"llama.embedding_length=512 but tensor 'token_embd.weight' has shape \(49152, 576\)"),
    ("llama.block_count", 4, struct.pack("<I", 2**31), "llama.block_count must be"),
    ("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", math.nan),
     "layer_norm_rms_epsilon must be a finite number > 0, got nan"),
    ("llama.rope.freq_base", 6, struct.pack("<f", math.inf), "freq_base must be a finite number > 0"),
    ("llama.rope.freq_base", 6, struct.pack("<f", -1.0), "got -1.0"),
])
def test_absurd_metadata_values_are_refused_by_name(tmp_path, smollm_gguf, smollm_head,
                                                     key, type_id, packed, match):
    at = _value_at(smollm_head, key, type_id)
    path = _gguf(tmp_path, _patched(smollm_head, at, packed), smollm_gguf.stat().st_size)
    assert _refused(path, match).endswith(f" in {path}")


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, smollm_gguf, smollm_head):
    # SmolLM2 has no general.alignment: rename general.file_type (as long) and set it to 3
    at = _value_at(smollm_head, "general.file_type", 4)
    head = _patched(smollm_head, at - 4 - 17, b"general.alignment")
    path = _gguf(tmp_path, _patched(head, at, struct.pack("<I", 3)), smollm_gguf.stat().st_size)
    _refused(path, "general.alignment must be a power of two, got 3")


def test_a_header_only_hub_stub_is_read_without_its_data(tmp_path, smollm_head, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    stub = tmp_path / "hub-headers" / "host" / "repo" / "commit" / "x.header.gguf"
    stub.parent.mkdir(parents=True)
    stub.write_bytes(smollm_head[:1_785_664])  # exactly the header: no tensor data at all
    assert len(gguf_header(stub)[1]) == 272
    _refused(_gguf(tmp_path, smollm_head[:1_785_664]), "needs bytes")  # the same bytes elsewhere


def _hf_dir(tmp_path: Path, config: object, weights: bytes | None = None) -> Path:
    """An HF checkpoint dir: config.json (a dict is dumped as JSON) and model.safetensors (a
    small valid file unless weights are given)."""
    root = tmp_path / "hf"
    root.mkdir(exist_ok=True)
    text = json.dumps(config) if isinstance(config, dict) else config
    (root / "config.json").write_text(text)
    if weights is None:
        save_file({"model.norm.weight": torch.ones(8)}, str(root / "model.safetensors"))
    else:
        (root / "model.safetensors").write_bytes(weights)
    return root


@pytest.mark.parametrize("field, value, match", [
    ("num_attention_heads", 0, "num_attention_heads must be >= 1 and <= 2147483647, got 0"),
    ("hidden_size", 0, "hidden_size must be >= 1"),
    ("vocab_size", -5, "vocab_size must be >= 1 and <= 2147483647, got -5"),
    ("intermediate_size", 2**40, "got 1099511627776"),
    ("num_key_value_heads", 0, "num_key_value_heads must be >= 1"),
    ("head_dim", 0, "head_dim must be >= 1"),
    ("num_hidden_layers", "two", "num_hidden_layers must be an integer, got 'two'"),
    ("rms_norm_eps", math.nan, "rms_norm_eps must be a finite number > 0, got nan"),
    ("rope_theta", -1, "rope_theta must be a finite number > 0, got -1"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor must be a finite"),
    ("eos_token_id", [2, -1], "eos_token_id must be >= 0"),
    ("torch_dtype", ["bfloat16"], "torch_dtype must be a dtype name"),
    ("architectures", [{"a": 1}], "not supported"),
])
def test_absurd_config_json_values_are_refused_by_name(tmp_path, field, value, match):
    root = _hf_dir(tmp_path, dict(LLAMA_CONFIG, **{field: value}))
    message = _refused(root, match)
    assert message.endswith(f"in {root / 'config.json'}"), message


@pytest.mark.parametrize("text, match", [("{\"hidden_size\": ", "is not valid JSON"),
                                         ("[1, 2]", "must hold a JSON object, got list"),
                                         ("[" * 100_000, "is not valid JSON")])
def test_a_config_json_that_is_not_an_object_is_refused(tmp_path, text, match):
    _refused(_hf_dir(tmp_path, text), match)


def _safetensors_bytes(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("weights, match", [
    (b"\x01\x02", "too short for a safetensors file"),
    (struct.pack("<Q", 2**62) + b"{}", "header length is 4611686018427387904 bytes"),
    (struct.pack("<Q", 4) + b"\x80abc", "header is not valid JSON"),
    (_safetensors_bytes([1, 2]), "must be a JSON object"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}),
     "tensor 'w' must have a dtype string, a shape of integers >= 0"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [4]}}), "data_offsets"),
])
def test_a_safetensors_file_with_a_bad_header_is_refused(tmp_path, weights, match):
    root = _hf_dir(tmp_path, LLAMA_CONFIG, weights)
    ckpt = resolve_checkpoint(root)  # config.json alone is fine
    _refused(root / "model.safetensors", match, lambda _: checkpoint_num_params(ckpt))


def test_a_safetensors_file_cut_inside_its_data_is_refused_at_load(tmp_path):
    header = {"model.norm.weight": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}
    root = _hf_dir(tmp_path, LLAMA_CONFIG, _safetensors_bytes(header, b"\0" * 20))
    ckpt = resolve_checkpoint(root)
    assert checkpoint_num_params(ckpt) == (8, "safetensors headers")  # the header is honest
    _refused(root / "model.safetensors", "not a readable safetensors file",
             lambda _: load_weights(ckpt, {"model.norm.weight": torch.empty(8)}))


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    with pytest.raises(FileNotFoundError, match="has neither \\*.safetensors weights nor a .gguf"):
        resolve_checkpoint(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = resolve_checkpoint(tmp_path)  # an index alone plans memory before a download
    with pytest.raises(FileNotFoundError, match="names shards that are not in .*model-00001-of-00002"):
        load_weights(ckpt, {"model.norm.weight": torch.empty(8)})


def test_nan_or_inf_in_a_norm_or_bias_is_refused_by_name():
    params = {"model.embed_tokens.weight": torch.zeros(4, 8), "model.norm.weight": torch.ones(8),
              "model.layers.0.self_attn.q_proj.bias": torch.tensor([0.0, math.inf, math.nan, 1.0])}
    with pytest.raises(ModelFileError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias holds 2 "
                                              r"NaN or infinite values \(of 4\) in ckpt.gguf"):
        check_finite_vectors(params, "ckpt.gguf")
    del params["model.layers.0.self_attn.q_proj.bias"]
    check_finite_vectors(params, "ckpt.gguf")


def test_nan_norm_weights_are_refused_when_the_engine_loads_them(tmp_path, smollm_gguf):
    """The public entry: LLM(model=path) stops at the loaded norm (it served token 0 forever)."""
    for file in smollm_gguf.parent.iterdir():  # the exported tokenizer: loads in well under 1 s
        if file.is_file() and file.suffix not in (".gguf", ".verified"):
            shutil.copy(file, tmp_path / file.name)
    tensors = gguf_header(smollm_gguf)[1]
    norm = next(t for t in tensors if t.name == "blk.3.ffn_norm.weight")
    assert norm.qtype.name == "F32"
    path = tmp_path / "nan.gguf"
    shutil.copy(smollm_gguf, path)
    with open(path, "r+b") as fh:
        fh.seek(norm.offset + 4 * 100)
        fh.write(struct.pack("<f", math.nan))
    _refused(path, r"model\.layers\.3\.post_attention_layernorm\.weight holds 1 NaN",
             lambda p: LLM(model=str(p), device="cpu", max_model_len=64))


def test_the_public_entry_refuses_a_truncated_gguf_before_anything_else(tmp_path, smollm_head):
    # no tokenizer files beside it: transformers' GGUF tokenizer would be next to read it
    path = _gguf(tmp_path, smollm_head)
    _refused(path, "truncated", lambda p: LLM(model=str(p), device="cpu"))


def test_the_gguf_tokenizer_refuses_a_truncated_file_before_transformers_reads_it(tmp_path,
                                                                                  smollm_head):
    _refused(_gguf(tmp_path, smollm_head), "truncated", load_tokenizer)  # was a numpy reshape error


def test_doctor_prints_one_line_for_a_corrupt_gguf(tmp_path, smollm_head):
    path = _gguf(tmp_path, smollm_head[:1_000])
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "doctor", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1  # the CLI's refusal status
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert str(path) in out.stderr and "truncated or corrupt" in out.stderr
