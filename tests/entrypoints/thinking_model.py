"""A tiny Qwen3 (transformers' own Qwen3ForCausalLM) that thinks: its weights make it a bigram
model following one fixed chain, so that its output is known text and a test can check where
the reasoning, the answer and the constraint go. The tokenizer is Qwen2.5's (the suite's
exported checkpoint) with Qwen3's <think> and </think> added as plain tokens, and the chat
template is Qwen3's as published (tests/data/qwen3_chat_template.jinja).

How: every layer's attention output and MLP down projection are zero, so the last hidden
state is the current token's embedding. Each chain token's embedding is its own unit vector,
and the untied output row of the token that follows it points the same way, so greedy decoding
(and HF transformers' generate) walks the chain:

    "\\n" -> <think> -> "Hmm" -> "," -> " okay" -> </think> -> "\\n\\n" -> "Hello" -> <|im_end|>

A Qwen3 chat prompt ends with "<|im_start|>assistant\\n" (so the model opens its thinking),
or, with enable_thinking=false, with "</think>\\n\\n" (so it answers "Hello" at once).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AddedToken, AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "qwen3_chat_template.jinja"
CHAIN = ["\n", "<think>", "Hmm", ",", " okay", "</think>", "\n\n", "Hello", "<|im_end|>"]
REASONING, ANSWER = "Hmm, okay", "Hello"
HIDDEN = 64


def build_thinking_qwen3(qwen_hf_dir: Path, out: Path) -> Path:
    """The model, its tokenizer and Qwen3's template as an HF checkpoint directory in out."""
    tok = AutoTokenizer.from_pretrained(str(qwen_hf_dir))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>")])
    tok.chat_template = TEMPLATE.read_text()
    ids = []
    for piece in CHAIN:
        encoded = tok.encode(piece, add_special_tokens=False)
        assert len(encoded) == 1, (piece, encoded)
        ids.append(encoded[0])
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, eos_token_id=ids[-1],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, (tok_id, next_id) in enumerate(zip(ids, ids[1:])):
            emb[tok_id] = 0.0
            emb[tok_id, i] = 1.0
            head[next_id, :len(ids)] = 0.0
            head[next_id, i] = 2.0  # logit 16 (the normed hidden is 8 e_i) vs ~0.2 for others
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    GenerationConfig(eos_token_id=[ids[-1]], do_sample=False).save_pretrained(str(out))
    return out


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of prompt_ids (the reference)."""
    model = Qwen3ForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()
