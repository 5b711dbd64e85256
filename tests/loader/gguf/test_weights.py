"""GGUF loading against what transformers produces from the same real GGUF files."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pagedllm.config import ModelArchConfig
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.gguf import header
from pagedllm.loader.gguf.header import read_gguf_header
from pagedllm.loader.gguf.weights import (arch_from_gguf, hf_name, iter_gguf_weights,
                                          load_gguf_weights)
from pagedllm.loader.hf.arch import arch_from_hf_config
from pagedllm.hub.model_store import ensure_model
from pagedllm.tokenizer.tokenizer import load_tokenizer

MODELS = ("qwen", "smollm")
# Fields where GGUF metadata and transformers' config.json must agree (dtype differs by design).
ARCH_FIELDS = [f.name for f in dataclasses.fields(ModelArchConfig) if f.name != "torch_dtype"]


def _hf_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The float32 state dict transformers saved after loading the GGUF (tied lm_head omitted)."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _hf_shapes(hf_dir: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    """Each saved tensor's shape and dtype, read without loading it."""
    return dict(_hf_tensors(hf_dir, meta=True))


def _hf_tensors(hf_dir: Path, meta: bool = False):
    """(name, tensor) of each saved tensor, loaded one at a time; with meta, (name, (shape,
    dtype)) without loading the data."""
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            names = list(fh.keys())
        for name in names:  # the file's map closes after each tensor: its pages leave the RSS
            with safe_open(str(file), "pt") as fh:
                if meta:
                    piece = fh.get_slice(name)
                    yield name, (piece.get_shape(), _DTYPES[piece.get_dtype()])
                else:
                    yield name, fh.get_tensor(name)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(scope="module", params=MODELS)
def model_case(request, qwen_gguf, smollm_gguf, qwen_hf_dir, smollm_hf_dir):
    """(gguf path, HF dir exported from it by transformers) for each real model."""
    return {"qwen": (qwen_gguf, qwen_hf_dir), "smollm": (smollm_gguf, smollm_hf_dir)}[request.param]


@pytest.mark.parametrize("chunk", [1 << 22, 1000])  # 1000 bytes: refills inside strings and arrays
def test_header_matches_gguf_reader(smollm_gguf, chunk, monkeypatch):
    monkeypatch.setattr(header._HeaderReader, "_CHUNK", chunk)
    with open(smollm_gguf, "rb") as fh:
        fields, tensors = read_gguf_header(fh)
    reader = gguf.GGUFReader(str(smollm_gguf))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = None if field.types[0] == gguf.GGUFValueType.ARRAY else field.contents()
        assert fields[key] == expected, key
    assert [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes)
        for t in reader.tensors]


def test_arch_matches_transformers_config(model_case):
    gguf_path, hf_dir = model_case
    ours = arch_from_gguf(gguf_path)
    theirs = arch_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    for name in ARCH_FIELDS:
        assert getattr(ours, name) == getattr(theirs, name), name


def test_weights_equal_transformers(model_case):
    gguf_path, hf_dir = model_case
    # one tensor of each at a time: the default model's float32 copies would take 2.5 GB each
    files = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            files.update(dict.fromkeys(fh.keys(), file))
    compared = set()
    for name, ours in iter_gguf_weights(gguf_path):
        with safe_open(str(files[name]), "pt") as fh:  # closed after each: its pages leave the RSS
            assert torch.equal(ours, fh.get_tensor(name)), name
        compared.add(name)
    assert compared == set(files)


def test_llama_qk_are_unpermuted_and_tied_head_filled(smollm_gguf, smollm_hf_dir):
    expected = _hf_state_dict(smollm_hf_dir)
    assert "lm_head.weight" not in expected  # tied: transformers does not save it
    params = {name: torch.empty_like(t, dtype=torch.bfloat16) for name, t in expected.items()}
    params["lm_head.weight"] = torch.empty_like(params["model.embed_tokens.weight"])
    load_gguf_weights(smollm_gguf, params)
    assert torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])
    q = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(params[q], expected[q].to(torch.bfloat16))
    # The raw GGUF rows differ (llama.cpp's interleaved rope layout), so un-permuting mattered.
    with open(smollm_gguf, "rb") as fh:
        info = next(t for t in read_gguf_header(fh)[1] if t.name == "blk.3.attn_q.weight")
    assert hf_name(info.name) == q
    raw = gguf.GGUFReader(str(smollm_gguf)).tensors
    raw_q = next(t for t in raw if t.name == info.name)
    dequantized = torch.from_numpy(gguf.quants.dequantize(raw_q.data, raw_q.tensor_type).copy())
    assert not torch.equal(dequantized, expected[q])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_rss_within_final_plus_25_percent(qwen_gguf):
    script = textwrap.dedent(f"""
        import json, psutil, torch
        from pagedllm.loader.gguf.header import read_gguf_header
        from pagedllm.loader.gguf.weights import hf_name, load_gguf_weights
        with open({str(qwen_gguf)!r}, "rb") as fh:
            tensors = read_gguf_header(fh)[1]
        params = {{hf_name(t.name): torch.empty(t.shape, dtype=torch.float32) for t in tensors}}
        allocated = psutil.Process().memory_info().rss
        load_gguf_weights({str(qwen_gguf)!r}, params)
        final = psutil.Process().memory_info().rss
        # VmHWM, not ru_maxrss: on Linux the latter can report the forking parent's peak.
        status = open("/proc/self/status").read().split("VmHWM:")[1]
        peak = int(status.split()[0]) * 1024
        print(json.dumps({{"allocated": allocated, "final": final, "peak": peak}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    mib = {k: v / 2**20 for k, v in rss.items()}
    print(f"qwen float32 load RSS MiB: {mib}")
    assert rss["final"] > rss["allocated"] + 2_000 * 2**20  # the weights really became resident
    assert rss["peak"] <= 1.25 * rss["final"], mib


@pytest.fixture(scope="module")
def smollm_params(smollm_hf_dir):
    """Empty float32 destinations shaped like the SmolLM2 model (tied)."""
    return {name: torch.empty_like(t) for name, t in _hf_state_dict(smollm_hf_dir).items()}


def test_missing_tensor_is_named(smollm_gguf, smollm_params):
    params = dict(smollm_params, **{"model.layers.30.mlp.up_proj.weight": torch.empty(1536, 576)})
    with pytest.raises(ValueError, match=r"model\.layers\.30\.mlp\.up_proj\.weight"):
        load_gguf_weights(smollm_gguf, params)


def test_unexpected_tensor_is_named(smollm_gguf, smollm_params):
    params = {k: v for k, v in smollm_params.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight"):
        load_gguf_weights(smollm_gguf, params)


def test_wrong_shape_is_named(smollm_gguf, smollm_params):
    params = dict(smollm_params, **{"model.norm.weight": torch.empty(577)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*577"):
        load_gguf_weights(smollm_gguf, params)


def _tiny_gguf(path: Path, arch: str, **metadata) -> Path:
    """A GGUF with one embedding tensor and the given `<arch>.*` / tokenizer metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        key = key.replace("__", ".")
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
        arch_from_gguf(_tiny_gguf(tmp_path / "tiny.gguf", "gpt2"))


def test_rope_scaling_and_end_of_turn_metadata(tmp_path):
    path = _tiny_gguf(
        tmp_path / "tiny.gguf", "llama", llama__block_count=1, llama__context_length=64,
        llama__embedding_length=8, llama__feed_forward_length=16, llama__attention__head_count=2,
        llama__attention__layer_norm_rms_epsilon=1e-5, llama__rope__scaling__type="linear",
        llama__rope__scaling__factor=4.0, llama__rope__scaling__original_context_length=16,
        tokenizer__ggml__eos_token_id=2, tokenizer__ggml__eot_token_id=3)
    arch = arch_from_gguf(path)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 16}
    assert (arch.eos_token_ids, arch.vocab_size, arch.head_dim, arch.num_key_value_heads) == ((2, 3), 4, 4, 2)
    assert (arch.tie_word_embeddings, arch.attention_bias, arch.rope_theta) == (True, False, 10000.0)
    with pytest.raises(ValueError, match="'llama.embedding_length'"):
        arch_from_gguf(_tiny_gguf(tmp_path / "bad.gguf", "llama"))


def test_resolve_checkpoint_and_tokenizer(smollm_gguf):
    ckpt = resolve_checkpoint(smollm_gguf)
    assert (ckpt.kind, ckpt.path) == ("gguf", smollm_gguf)
    assert ckpt.arch == arch_from_gguf(smollm_gguf)
    model_dir = ensure_model("smollm2-135m-instruct")  # exports tokenizer files beside the GGUF
    for model in (smollm_gguf, model_dir):
        resolved = resolve_checkpoint(model)
        assert (resolved.kind, resolved.path, resolved.tokenizer_path) == ("gguf", smollm_gguf, model_dir)
    tok = load_tokenizer(smollm_gguf)
    reader = gguf.GGUFReader(str(smollm_gguf))
    assert tok.chat_template == reader.fields["tokenizer.chat_template"].contents()
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("Hello world") == load_tokenizer(model_dir).encode("Hello world")


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_exported_tokenizer_loads_fast_as_autotokenizer_does(name):
    """The model store's exported tokenizer, built straight from tokenizer.json, agrees with
    AutoTokenizer on ids, special tokens and the chat template (on composed text: AutoTokenizer's
    Qwen2Tokenizer adds an NFC normalizer the export does not have)."""
    from transformers import AutoTokenizer

    from pagedllm.tokenizer.fast_tokenizer import FastTokenizer

    model_dir = ensure_model(name)
    fast, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(fast) is FastTokenizer  # the direct path, without transformers
    text = "def f():\n    print('héllo  wörld')\t<|im_start|>user 12345 <|endoftext|> 😀"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    assert fast.encode(text) == auto.encode(text)
    assert fast.decode(fast.encode(text)) == auto.decode(auto.encode(text))
    assert (fast.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            == auto.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    assert fast.chat_template == auto.chat_template
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "model_max_length"):
        assert getattr(fast, attr) == getattr(auto, attr), attr
    assert len(fast) == len(auto)
