"""One decoder for the Llama family and Qwen2: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Qwen2 is Llama with biases on the q/k/v projections (config.attention_bias) and, for the small
models, embeddings tied to the output head (config.tie_word_embeddings). Parameter names follow
Hugging Face, so checkpoints load by name.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import paged_attention
from pagedllm.config import ModelArchConfig
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.ggml_linear import linear_many
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Self-attention with grouped K/V heads reading and writing the paged cache."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = linear_many(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(*linear_many(x, self.gate_proj, self.up_proj)))


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added) - the next norm adds
        them, in one fused op on the CPU."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embeddings, the layer stack and the final norm."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        # an explicit (uninitialised) weight skips nn.Embedding's normal_() init, which on the
        # meta device goes through a decomposition that imports torch._dynamo (~1.5 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings)
        # a C++ pass over all layers for decode-only steps (models/fused_decode.py), or None
        self.fused_decode = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, H] for flattened tokens input_ids [T] at positions [T]."""
        # the residual stream stays in float32 whatever the weights' dtype: in bf16 its rounding
        # error would otherwise flip near-tied greedy choices
        residual = self.model.embed_tokens(input_ids).float()  # [T, H]
        x = torch.zeros_like(residual)  # the first norm adds it: residual stays the embedding
        if self.fused_decode is not None and meta.decode is not None and not meta.prefills:
            dec = meta.decode
            x, residual = self.fused_decode.forward(x, residual, positions, kv_caches,
                                                    meta.slot_mapping, dec.block_table,
                                                    dec.context_lens)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, residual = layer(x, residual, positions, self.rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, V] for hidden states [N, H]."""
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama decoder with q/k/v biases (set by the config)."""
