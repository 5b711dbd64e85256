"""Tiny random pooling models and their tokenizers, built with transformers' own classes, shared
by the model tests and the server tests: a Qwen3 reranker (Qwen3-Reranker's shape)."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
# Qwen3-Reranker's prompt, formatted by the user as vLLM's example does
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
          "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
          "\"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERIES = ["What is the capital of China?", "Explain gravity"]
DOCS = ["The capital of China is Beijing.",
        "Gravity is a force that attracts two bodies towards each other."]


def yes_no_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE whose vocabulary has the tokens "no" and "yes" (as Qwen's has)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("n", "o"), ("y", "e"), ("ye", "s")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def reranker_pairs() -> tuple[list[str], list[str]]:
    queries = [f"{PREFIX}<Instruct>: Given a web search query, retrieve relevant passages\n"
               f"<Query>: {q}\n" for q in QUERIES]
    return queries, [f"<Document>: {d}{SUFFIX}" for d in DOCS]


def tiny_qwen3(cls: type, path: Path, seed: int, config_cls: type = Qwen3Config,
               **config) -> torch.nn.Module:
    """A random Qwen3 (or config_cls's family) model of transformers class `cls` (a causal LM
    or a sequence classifier) over yes_no_tokenizer's vocabulary, saved with it at path;
    weights N(0, 0.2^2), norms near 1, so that the two tokens' logits are spread out."""
    tok = yes_no_tokenizer()
    cfg = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, **config)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def yes_no_scores(path: Path, model: torch.nn.Module, queries: list[str],
                  docs: list[str]) -> torch.Tensor:
    """sigmoid(logit(yes) - logit(no)) at each pair's last position, as Qwen3-Reranker's
    model card computes it (softmax over the two, yes' share), from transformers' causal LM."""
    tok = AutoTokenizer.from_pretrained(path)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    out = []
    for q, d in zip(queries, docs):
        ids = torch.tensor([tok(q, d)["input_ids"]])
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        out.append(torch.sigmoid(last[yes] - last[no]))
    return torch.stack(out)


# XLM-RoBERTa's special tokens, at its ids (<s> 0, <pad> 1, </s> 2, <unk> 3)
XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
XLMR_CORPUS = ["what is the capital of france?", "Paris is the capital and largest city of France.",
               "The cat sat on the mat.", "Berlin is the capital of Germany.",
               "Gravity is a force that attracts two bodies towards each other.",
               "A man is playing a guitar on the street.", "who plays music in the city?"]


def xlmr_tokenizer() -> PreTrainedTokenizerFast:
    """A small Unigram (SentencePiece-style) tokenizer trained on XLMR_CORPUS, with XLM-R's
    specials and its pair template, <s> A </s></s> B </s>, as XLMRobertaTokenizerFast."""
    from tokenizers import normalizers, processors, trainers
    from transformers import XLMRobertaTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(XLMR_CORPUS * 20, trainers.UnigramTrainer(
        vocab_size=150, special_tokens=XLMR_SPECIALS, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    return XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<unk>")
