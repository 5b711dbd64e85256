"""llama.cpp's GGUF LoRA adapters: written from a PEFT adapter in the converter's layout
(conftest.write_lora_gguf), read back into the same matrices, scale alpha / r; what is not a
LoRA adapter for this base, or is of a type not read, refused by name (a toy architecture;
tests/e2e/test_lora.py runs one against its PEFT original on SmolLM2)."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from test_peft import ARCH, write_adapter

from pagedllm.loader.lora_adapter import check_adapter, load_adapter
from pagedllm.lora.request import LoRARequest

Q8 = gguf.GGMLQuantizationType.Q8_0


def _gguf(tmp_path, lora_gguf_writer, outtype="f32", **kw) -> tuple[LoRARequest, LoRARequest]:
    peft = write_adapter(tmp_path / "peft")
    out = lora_gguf_writer(tmp_path / "peft", tmp_path / f"a-{outtype}.gguf", "llama",
                           ARCH.head_dim, outtype, **kw)
    return peft, LoRARequest("g", 2, str(out))


@pytest.mark.parametrize("outtype, rounded", [
    ("f32", lambda t: t), ("f16", lambda t: t.half().float()),
    ("bf16", lambda t: t.bfloat16().float()), ("q8_0", None)])
def test_the_same_matrices_as_the_peft_original(tmp_path, lora_gguf_writer, outtype, rounded):
    peft, request = _gguf(tmp_path, lora_gguf_writer, outtype)
    want, got = load_adapter(peft, ARCH, 8), load_adapter(request, ARCH, 8)
    assert got.config == want.config  # r=4, alpha / r = 2.0
    assert sorted(got.weights) == sorted(want.weights) == [(1, "down_proj"), (1, "q_proj")]
    for target, pair in want.weights.items():
        for w, g in zip(pair, got.weights[target]):
            assert g.dtype == torch.float32 and g.shape == w.shape
            if rounded is not None:  # q_proj's B un-permuted: its rows in HF's order
                assert torch.equal(g, rounded(w)), (target, outtype)
            elif w.shape[1] % 32:  # lora_b [out, r=4]: F16, as the converter falls back
                assert torch.equal(g, w.half().float())
            else:  # Q8_0: each block of 32 within half a step max|x| / 127 (and the step's own
                # rounding to f16 times 127)
                step = w.reshape(w.shape[0], -1, 32).abs().amax(-1) / 127
                err = (g - w).reshape(w.shape[0], -1, 32).abs().amax(-1)
                assert (err <= 0.6 * step).all() and not torch.equal(g, w)


def test_only_the_llama_architecture_has_its_q_rows_put_back(tmp_path, lora_gguf_writer):
    """convert_hf_to_gguf permutes Q/K for llama (and SmolLM3) only: a qwen2 adapter's rows
    are HF's already."""
    peft = write_adapter(tmp_path / "peft")
    qwen = dataclasses.replace(ARCH, architecture="qwen2")
    out = lora_gguf_writer(tmp_path / "peft", tmp_path / "q.gguf", "qwen2", ARCH.head_dim)
    want, got = load_adapter(peft, qwen, 8), load_adapter(LoRARequest("g", 2, str(out)), qwen, 8)
    assert all(torch.equal(w, g) for t in want.weights
               for w, g in zip(want.weights[t], got.weights[t]))
    as_llama = lora_gguf_writer(tmp_path / "peft", tmp_path / "l.gguf", "llama", ARCH.head_dim)
    with pytest.raises(ValueError, match="general.architecture='llama': the adapter is for "
                                         "another architecture .*'qwen2'"):
        check_adapter(LoRARequest("l", 3, str(as_llama)), qwen, 8)


def test_a_zero_alpha_means_a_scale_of_one_as_in_llama_cpp(tmp_path, lora_gguf_writer):
    _, request = _gguf(tmp_path, lora_gguf_writer, alpha=0.0)
    assert check_adapter(request, ARCH, 8).scale == 1.0


def _write(path, fields: dict, tensors: dict[str, np.ndarray], arch: str = "llama",
           qtype=None):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    for name, data in tensors.items():
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return LoRARequest("x", 1, str(path))


LORA = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0}
Q = {"blk.1.attn_q.weight.lora_a": np.zeros((4, 32), np.float32),
     "blk.1.attn_q.weight.lora_b": np.zeros((32, 4), np.float32)}


@pytest.mark.parametrize("fields, tensors, arch, message", [
    ({"general.type": "model"}, Q, "llama", "general.type='model': not a LoRA adapter"),
    ({**LORA, "adapter.type": "control_vector"}, Q, "llama",
     "adapter.type='control_vector' is not supported; only 'lora'"),
    (LORA, Q, "qwen2", "general.architecture='qwen2': the adapter is for another architecture"),
    (LORA, {**Q, "blk.1.attn_k.weight.lora_a": np.zeros((4, 32), np.float32),
            "blk.1.attn_k.weight.lora_b": np.zeros((32, 4), np.float32)}, "llama",
     "tensor 'blk.1.attn_k.weight.lora_b' has shape \\[32, 4\\], but the base model's k_proj "
     "\\(r=4\\) needs \\[16, 4\\]"),
    (LORA, {"blk.1.attn_q.weight.lora_a": np.zeros((4, 32), np.float32)}, "llama",
     "layer 1's q_proj has no lora_b tensor"),
    (LORA, {**Q, "blk.0.attn_norm.weight": np.ones(32, np.float32)}, "llama",
     "tensor 'blk.0.attn_norm.weight' is a norm weight"),
    (LORA, {"token_embd.weight.lora_a": np.zeros((4, 32), np.float32)}, "llama",
     "tensor 'token_embd.weight.lora_a' targets embeddings or the output head"),
    (LORA, {"blk.7.attn_q.weight.lora_a": np.zeros((4, 32), np.float32)}, "llama",
     "is for layer 7, but the base model has 2 layers"),
    (LORA, {"blk.1.attn_q.weight.lora_a": np.zeros((16, 32), np.float32),
            "blk.1.attn_q.weight.lora_b": np.zeros((32, 16), np.float32)}, "llama",
     "r=16 is over max_lora_rank=8"),
    (LORA, {**Q, "blk.1.ffn_up.weight.lora_a": np.zeros((2, 32), np.float32),
            "blk.1.ffn_up.weight.lora_b": np.zeros((48, 2), np.float32)}, "llama",
     "tensor 'blk.1.ffn_up.weight.lora_a' has rank 2, others 4: every module must share"),
])
def test_what_is_not_a_lora_adapter_for_this_base_is_refused_by_name(tmp_path, fields, tensors,
                                                                     arch, message):
    request = _write(tmp_path / "a.gguf", fields, tensors, arch)
    with pytest.raises(ValueError, match=message):
        check_adapter(request, ARCH, 8)


def test_a_type_not_read_and_a_path_that_is_no_file_are_refused(tmp_path):
    q4 = {"blk.1.attn_q.weight.lora_a": np.ones((4, 32), np.float32)}
    request = _write(tmp_path / "q4.gguf", LORA, q4, qtype=gguf.GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="tensor 'blk.1.attn_q.weight.lora_a' is Q4_0; LoRA "
                                         "tensors are read as F32, F16, BF16, Q8_0"):
        check_adapter(request, ARCH, 8)
    with pytest.raises(ValueError, match="is not a file \\(a llama.cpp LoRA adapter's .gguf\\)"):
        check_adapter(LoRARequest("x", 1, str(tmp_path / "missing.gguf")), ARCH, 8)
    (tmp_path / "junk.gguf").write_bytes(b"not gguf")
    with pytest.raises(ValueError, match="lora_request.lora_path: .*not a GGUF file"):
        check_adapter(LoRARequest("x", 1, str(tmp_path / "junk.gguf")), ARCH, 8)
