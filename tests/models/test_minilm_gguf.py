"""The real all-MiniLM-L6-v2 as the GGUF llama.cpp's converter makes of it (written here by
bert_gguf.py, tensor for tensor and key for key the converter's output), f32 and f16: the
embeddings against sentence-transformers' pipeline on the safetensors checkpoint (cosine >=
0.9999 in f32), and its WordPiece tokenizer, built from the GGUF's vocabulary, against
BertTokenizerFast's ids."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from bert_gguf import write_bert_gguf
from pagedllm import LLM
from pagedllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from test_minilm import CORPUS, QUERIES, st_reference

# accents, punctuation, case, digits, unknown and long words, CJK, emoji, control characters,
# special-token text, whitespace runs
TOKENIZER_TEXTS = [
    "Hello, world!", "Café naïve résumé — déjà vu", "ÅNGSTRÖM Ünïcödé São Paulo",
    "unbelievably xylophonist qwzxvbnm", "The QUICK brown fox's 3.14 jumps!!",
    "中文字符 and emoji 😀 ☃", "a\tb\nc   d \u00a0e", "[CLS] inside text [SEP] [MASK]",
    "don't won't can't", "e-mail: someone@example.com, #hashtag $5.00 (50%)",
    "x" * 120, "pneumonoultramicroscopicsilicovolcanoconiosis", "\u0007bell\u200bzero", "",
]


@pytest.fixture(scope="session")
def minilm_ggufs(minilm_dir, tmp_path_factory):
    """all-MiniLM-L6-v2 converted to f32 and f16 GGUFs, each alone in its folder (so that the
    GGUF's own vocabulary is the tokenizer, not the files beside it)."""
    root = tmp_path_factory.mktemp("minilm-gguf")
    out = {}
    for outtype in ("f32", "f16"):
        (root / outtype).mkdir()
        out[outtype] = write_bert_gguf(minilm_dir, root / outtype / f"minilm-{outtype}.gguf",
                                       outtype)
    return out


@pytest.mark.parametrize("outtype, min_cos", [("f32", 0.9999), ("f16", 0.999)])
def test_gguf_embeddings_match_sentence_transformers(minilm_ggufs, minilm_dir, outtype, min_cos):
    llm = LLM(str(minilm_ggufs[outtype]), device="cpu", dtype="float32")
    config = llm.llm_engine.config
    # bert.pooling_type 1 (mean), L2-normalised as llama.cpp's embeddings server does
    assert (config.pooler.pooling_type, config.pooler.normalize) == ("mean", True)
    assert config.quantization == "none" and config.scheduler.max_model_len == 512
    texts = CORPUS + QUERIES
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    ref = st_reference(minilm_dir, texts)
    cos = F.cosine_similarity(ours, ref, dim=1)
    assert cos.min().item() >= min_cos, cos
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


def test_gguf_tokenizer_ids_equal_bert_tokenizer_fast(minilm_ggufs, minilm_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(minilm_dir)
    ours = tokenizer_from_gguf(minilm_ggufs["f32"])
    assert ours.get_vocab() == ref.get_vocab()  # the phantom-space spelling undone exactly
    for text in TOKENIZER_TEXTS + CORPUS + QUERIES:
        assert ours.encode(text) == ref(text)["input_ids"], text
    assert ours.decode(ours.encode(TOKENIZER_TEXTS[1]), skip_special_tokens=True) == \
        ref.decode(ref(TOKENIZER_TEXTS[1])["input_ids"], skip_special_tokens=True)
    for name in ("cls_token", "sep_token", "unk_token", "pad_token", "mask_token"):
        assert ours.special_tokens_map[name] == getattr(ref, name)
