"""Gemma 2 and 3: the Llama decoder's attention and gated MLP, rearranged.

- embeddings scaled by sqrt(hidden), in the embedding's dtype (as transformers does);
- RMSNorm scaling by (1 + w) (layers/norm.py GemmaRMSNorm), four per layer: before and after
  attention, before and after the feed-forward block;
- GeGLU (gelu_tanh) feed-forward;
- attention scaled by query_pre_attn_scalar ** -0.5, its scores soft-capped, and every other
  layer (config.gemma.sliding_layers) attending over the last sliding_window tokens only:
  attention/masked.py, in plain PyTorch in every backend;
- final logits soft-capped; the head tied to the embeddings.

Gemma 3 (text) keeps that layer and adds, all set by the config: per-head q/k norms scaling by
(1 + w) (config.qk_norm), five sliding layers to one global (config.gemma.sliding_layers), the
sliding layers turning by their own unscaled RoPE base (gemma.rope_local_base_freq) while the
global ones use rope_theta and rope_scaling; no attention soft-cap, the final one optional.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.config import ModelArchConfig
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaForCausalLM, SelfAttention


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm; residual; norm, GeGLU, norm; residual."""

    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__()
        h, eps, g = cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = SelfAttention(cfg, rope, GemmaRMSNorm, g.query_pre_attn_scalar ** -0.5,
                                       cfg.layer_window(index), g.attn_logit_softcapping)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, gelu=True)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added), as the Llama layer:
        the next layer's input norm (or the final norm) adds them."""
        x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaDecoderModel(nn.Module):
    """Embeddings, the Gemma layer stack and the final (1 + w) norm."""

    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        # an explicit weight skips nn.Embedding's init (see llama.DecoderModel)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        local_base = cfg.gemma.rope_local_base_freq
        # Gemma 3's sliding layers' table (Gemma 2's share the one)
        self.local_rope = None if local_base is None else rope.with_base(local_base)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, self._layer_rope(cfg, rope, i), i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _layer_rope(self, cfg: ModelArchConfig, rope: RotaryEmbedding,
                    index: int) -> RotaryEmbedding:
        """The RoPE tables layer `index` turns q and k by."""
        if self.local_rope is not None and index in cfg.gemma.sliding_layers:
            return self.local_rope
        return rope


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 over a paged KV cache (config.gemma set)."""

    decoder_cls = GemmaDecoderModel

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        if cfg.gemma is None:
            raise ValueError(f"{cfg.architecture}: config.gemma must be set for a Gemma model")
        super().__init__(cfg, max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, H] in float32: embeddings times sqrt(hidden), the product
        taken in the embeddings' dtype as transformers does."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        return (x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, V], soft-capped when the config says so."""
        logits = self.lm_head(hidden)
        cap = self.config.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_head(self) -> Optional[nn.Module]:
        """The module whose output compute_logits is, as it is; None under soft-capping (a
        tanh can make logits equal that were not)."""
        return self.lm_head if self.config.gemma.final_logit_softcapping is None else None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text over a paged KV cache: Gemma 2's model, its departures set by the config
    (q/k norms, the local RoPE table, the layer pattern, no attention soft-cap)."""
