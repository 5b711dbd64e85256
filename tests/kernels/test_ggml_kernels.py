"""The GGML block kernels against gguf-py's reference dequantization, on random and real tensors."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from pagedllm.kernels import load_kernels
from pagedllm.layers.ggml_linear import (DENSE_MIN_ROWS, KERNEL_TYPES, GGMLEmbedding, GGMLLinear,
                                         dequantize, ggml_matmul)
from pagedllm.layers.quantization import quantize_q4_1, quantize_q8_0
from pagedllm.loader.gguf.header import read_gguf_header

# byte offsets of the fp16 scale/min fields inside one block of each type
HALF_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
               T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
               T.IQ4_NL: [0], T.IQ4_XS: [0]}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernels()


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes [rows, row_bytes] with finite, small fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        half = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def test_every_kernel_type_is_covered():
    assert set(HALF_FIELDS) == set(KERNEL_TYPES)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_dequantize_is_exact(qtype):
    raw = random_blocks(qtype, 37, 512)
    ref = gguf_dequantize(raw, qtype).reshape(37, 512)
    got = dequantize(torch.from_numpy(raw), qtype, 512).numpy()
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_linear_matches_dequantize_then_matmul(qtype, m):
    raw = torch.from_numpy(random_blocks(qtype, 70, 768, seed=m))  # 70 rows: a partial tile
    w = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(70, 768))
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.double().t()
    exact = torch.ops.pagedllm.ggml_linear(x, raw, int(qtype), 768)  # float32 throughout
    assert rel_error(exact, ref) < 1e-6


@pytest.mark.parametrize("chunk", [None, 256 * 10])
def test_large_batches_take_the_exact_dense_path(chunk, monkeypatch):
    if chunk is not None:  # a vocabulary-sized matrix is dequantized in row chunks
        monkeypatch.setattr("pagedllm.layers.ggml_linear.DENSE_CHUNK_ELEMENTS", chunk)
    raw = torch.from_numpy(random_blocks(T.Q5_0, 64, 256))
    w = dequantize(raw, T.Q5_0, 256)
    x = torch.randn(DENSE_MIN_ROWS, 256)
    torch.testing.assert_close(ggml_matmul(x, raw, T.Q5_0, 256), x @ w.t())


def test_linear_and_embedding_modules():
    raw = torch.from_numpy(random_blocks(T.Q8_0, 48, 64))
    w = dequantize(raw, T.Q8_0, 64)
    lin = GGMLLinear(64, 48, T.Q8_0, bias=True, dtype=torch.float32)
    lin.weight.data, lin.bias.data = raw, torch.randn(48)
    x = torch.randn(2, 5, 64)
    assert rel_error(lin(x), x @ w.t() + lin.bias) < 0.02
    emb = GGMLEmbedding(48, 64, T.Q8_0)
    emb.weight.data = raw
    ids = torch.tensor([[3, 0], [47, 3]])
    torch.testing.assert_close(emb(ids), w[ids], rtol=0, atol=0)


def test_bad_shapes_are_clear_errors():
    raw = torch.from_numpy(random_blocks(T.Q4_0, 4, 64))
    with pytest.raises(RuntimeError, match="row_bytes"):
        torch.ops.pagedllm.ggml_linear(torch.randn(1, 96), raw, int(T.Q4_0), 96)
    with pytest.raises(ValueError, match="in_features=40"):
        GGMLLinear(40, 8, T.Q4_0, bias=False)


@pytest.mark.parametrize("quantize,qtype,levels", [(quantize_q8_0, T.Q8_0, 254),
                                                   (quantize_q4_1, T.Q4_1, 15)])
def test_float_quantizers_write_valid_blocks(quantize, qtype, levels):
    w = torch.randn(16, 256) * torch.linspace(0.01, 3, 256)
    blocks = quantize(w)
    back = torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype).reshape(16, 256))
    spread = w.reshape(16, 8, 32)
    step = (spread.amax(-1) - spread.amin(-1)) / levels if levels == 15 else \
        spread.abs().amax(-1) / 127
    err = (back - w).abs().reshape(16, 8, 32).amax(-1)
    assert torch.all(err <= step * 0.5 + 1e-3 * step + 1e-6)


def _real_tensors(path, wanted):
    """(qtype, raw rows) of the first tensor of each wanted type in a GGUF (at most 64 rows)."""
    with open(path, "rb") as fh:
        tensors = read_gguf_header(fh)[1]
        found = {}
        for info in tensors:
            if info.qtype in wanted and info.qtype not in found and len(info.shape) == 2:
                rows = min(64, info.shape[0])
                fh.seek(info.offset)
                raw = np.frombuffer(fh.read(rows * info.nbytes // info.shape[0]), dtype=np.uint8)
                found[info.qtype] = (info.shape[1], raw.reshape(rows, -1).copy())
    return found


def test_real_tensors_of_both_models(qwen_gguf, smollm_gguf):
    found = _real_tensors(qwen_gguf, KERNEL_TYPES) | _real_tensors(smollm_gguf, KERNEL_TYPES)
    assert {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.Q4_1} <= set(found)
    for qtype, (cols, raw) in found.items():
        ref = gguf_dequantize(raw, qtype).reshape(raw.shape[0], cols)
        w = torch.from_numpy(raw)
        np.testing.assert_array_equal(dequantize(w, qtype, cols).numpy(), ref)
        x = torch.randn(2, cols)
        out = torch.ops.pagedllm.ggml_linear(x, w, int(qtype), cols)
        assert rel_error(out, x.double() @ torch.from_numpy(ref).double().t()) < 1e-6, qtype.name


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_low_bit_types_dequantize_as_ggml_itself(qtype):
    """Against ggml's own dequantize_row_* in a built libggml-base (PAGEDLLM_TEST_LIBGGML names
    it, e.g. llama.cpp's build/bin/libggml-base.so), beyond gguf-py's numpy reference."""
    path = os.environ.get("PAGEDLLM_TEST_LIBGGML")
    if not path:
        pytest.skip("PAGEDLLM_TEST_LIBGGML is not set (the path of a built libggml-base.so)")
    fn = getattr(ctypes.CDLL(path), "dequantize_row_" + {T.Q2_K: "q2_K", T.Q3_K: "q3_K", T.IQ4_NL: "iq4_nl",
                                                  T.IQ4_XS: "iq4_xs"}[qtype])
    raw = random_blocks(qtype, 16, 1024, seed=11)
    ref = np.empty(16 * 1024, np.float32)
    fn(raw.ctypes.data_as(ctypes.c_void_p), ref.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(ref.size))
    np.testing.assert_array_equal(dequantize(torch.from_numpy(raw), qtype, 1024).numpy().reshape(-1), ref)
