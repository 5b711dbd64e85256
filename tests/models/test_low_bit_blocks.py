"""The GGUF types that make a 7B fit a small machine (Q2_K, Q3_K, IQ4_XS) kept in blocks through
the whole model: a tiny random Qwen2 whose layer matrices are random blocks of each type, against
transformers on the values those blocks decode to (gguf's own dequantization). IQ4_NL as
llama.cpp writes it into an IQ4_XS file: for the matrices whose rows are not a multiple of 256
(here down_proj's 544 values), the rest IQ4_XS."""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import Qwen2Config, Qwen2ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM
from pagedllm.layers.ggml_linear import GGMLLinear, GGMLMergedLinear
from tiny_models import (CHUNKED, VOCAB, base_fields, check_q8_0, gguf_tensors, prompts,
                         random_init, save_hf_dir, write_gguf_blocks)

# where each type's fp16 scales sit in its block (ggml's block_q2_K / block_q3_K / block_iq4_xs),
# and a magnitude that keeps the tiny model's weights around 0.03-0.3 (larger ones make 32 greedy
# steps of 8-bit activations drift past the tolerance on these random weights)
HALF_FIELDS = {T.Q2_K: ((80, 0.001), (82, 0.001)), T.Q3_K: ((108, 0.0025),), T.IQ4_XS: ((0, 0.00012),),
               T.IQ4_NL: ((0, 0.0016),)}
# llama.cpp's IQ4_XS file: IQ4_NL where a row is not whole 256-value super-blocks
IQ4_XS_WITH_NL = "IQ4_XS+IQ4_NL"


def block_type(file_type: T | str, cols: int) -> T:
    """The block type of a matrix with rows of cols values in a file of file_type."""
    if file_type == IQ4_XS_WITH_NL:
        return T.IQ4_XS if cols % 256 == 0 else T.IQ4_NL
    return file_type


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks [rows, bytes]: random value and scale bits, finite scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset, scale in HALF_FIELDS[qtype]:
        half = (np.abs(rng.standard_normal((rows, cols // block))) * scale).astype(np.float16)
        raw[:, :, offset:offset + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module", params=[T.Q2_K, T.Q3_K, T.IQ4_XS, IQ4_XS_WITH_NL],
                ids=lambda t: getattr(t, "name", t))
def low_bit(request, tmp_path_factory):
    """(the GGUF path, the tokenizer's HF directory, transformers' model on the blocks' values,
    prompts, the block types) for one file type."""
    file_type = request.param
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=256,
                      intermediate_size=544 if file_type == IQ4_XS_WITH_NL else 512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen2ForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=0.2)
    root = tmp_path_factory.mktemp(getattr(file_type, "name", file_type))
    hf_dir = save_hf_dir(model, root / "hf")
    rng = np.random.default_rng(1)
    tensors = gguf_tensors(model, gguf.MODEL_ARCH.QWEN2)
    blocks, qtypes = {}, {}
    names = {v: k for k, v in _hf_to_gguf(model).items()}
    with torch.no_grad():
        for name, arr in tensors.items():
            if arr.ndim == 2 and name.startswith("blk."):
                qtype = qtypes[name] = block_type(file_type, arr.shape[1])
                raw = random_blocks(qtype, *arr.shape, rng)
                values = gguf.quants.dequantize(raw, qtype).reshape(arr.shape)
                model.get_parameter(names[name]).copy_(torch.from_numpy(values))
                blocks[name] = raw
    path = root / "model.gguf"
    write_gguf_blocks(path, "qwen2", lambda w: base_fields(w, cfg), tensors, blocks, qtypes)
    return SimpleNamespace(path=path, hf_dir=hf_dir, q8_0_model=model,
                           qtypes=set(qtypes.values()), prompts=prompts((5, 23, 40), seed=2))


def _hf_to_gguf(model) -> dict[str, str]:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, model.config.num_hidden_layers)
    out = {}
    for hf_name in model.state_dict():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is not None:
            out[hf_name] = name
    return out


def test_low_bit_blocks_are_kept_and_match_transformers(low_bit):
    llm = LLM(model=str(low_bit.path), tokenizer=str(low_bit.hf_dir), **CHUNKED)
    model = model_runner(llm).model
    kept = {t for m in model.modules() if isinstance(m, GGMLLinear) for t in [m.qtype]}
    kept |= {t for m in model.modules() if isinstance(m, GGMLMergedLinear) for t in m.qtypes}
    assert kept == low_bit.qtypes  # every layer matrix stays in its blocks
    check_q8_0(llm, low_bit)  # 8-bit activations: logits within 10% of the largest
