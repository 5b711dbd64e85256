"""BERT encoder GGUFs (llama.cpp's `bert` architecture) on tiny random BertModels against
transformers: each of llama.cpp's sequence poolings (`bert.pooling_type` 1 mean, 2 CLS, 3 last),
L2-normalised as llama.cpp's embeddings server does; what is no sequence embedding (pooling none
or rank, a classifier's head) refused by name. The real all-MiniLM GGUF: test_minilm_gguf.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bert_gguf import write_bert_gguf
from pagedllm import LLM
from pagedllm.loader.errors import ModelFileError
from pagedllm.loader.checkpoint import resolve_checkpoint
from test_bert import TEXTS, reference, tiny_bert

POOLINGS = {1: "mean", 2: "cls", 3: "last"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir):
    return tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "hf", minilm_dir,
                     modules=["Pooling"], pooling="mean")


@pytest.mark.parametrize("pooling_type", sorted(POOLINGS))
def test_each_pooling_matches_transformers(tiny_dir, tmp_path, pooling_type):
    gguf_path = write_bert_gguf(tiny_dir, tmp_path / "tiny.gguf", pooling_type=pooling_type)
    llm = LLM(str(gguf_path), device="cpu", dtype="float32")
    assert llm.llm_engine.config.pooler.pooling_type == POOLINGS[pooling_type]
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = reference(tiny_dir, TEXTS, POOLINGS[pooling_type], normalize=True)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("pooling_type, named", [(0, "none"), (4, "rank")])
def test_poolings_that_are_no_sequence_embedding_are_refused(tiny_dir, tmp_path, pooling_type,
                                                             named):
    gguf_path = write_bert_gguf(tiny_dir, tmp_path / "tiny.gguf", pooling_type=pooling_type)
    with pytest.raises(ModelFileError, match=f"bert.pooling_type={pooling_type} \\({named}"):
        LLM(str(gguf_path), device="cpu", dtype="float32")


def test_a_classifier_head_is_refused(tiny_dir, tmp_path):
    head = {"cls.output.weight": np.zeros((1, 64), np.float32),
            "cls.output.bias": np.zeros(1, np.float32)}
    gguf_path = write_bert_gguf(tiny_dir, tmp_path / "tiny.gguf", extra_tensors=head)
    with pytest.raises(ModelFileError, match="classification head"):
        resolve_checkpoint(gguf_path)


def test_block_quantization_of_an_encoder_is_refused(tiny_dir, tmp_path):
    gguf_path = write_bert_gguf(tiny_dir, tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="quantization='gguf' with a bert encoder"):
        LLM(str(gguf_path), device="cpu", quantization="gguf")
