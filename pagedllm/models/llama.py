"""One decoder for the Llama family, Qwen2, Qwen3, Phi-3 and the Qwen MoE models: RMSNorm,
RoPE, grouped-query attention, SwiGLU (or routed SwiGLU experts).

Qwen2 is Llama with biases on the q/k/v projections (config.attention_bias) and, for the small
models, embeddings tied to the output head (config.tie_word_embeddings). Qwen3 drops the biases
and normalises each head of q and k before RoPE (config.qk_norm). Phi-3 stores q/k/v and
gate/up fused in its checkpoint (the loaders split them into the shards below, loader/fused.py),
its long-context models use LongRoPE, and Phi-4-mini turns only 3/4 of each head (config.
rotary_dim; layers/rotary.py). Qwen2-MoE and Qwen3-MoE replace the MLP of their sparse layers
by routed experts (config.moe; layers/moe.py). SmolLM3 leaves q and k unturned on its NoPE
layers, every fourth by default (config.nope_layers). Parameter names follow
Hugging Face, except q/k/v and gate/up, which are merged modules that load the checkpoint's
separate tensors by shard (checkpoint_params). The model is plain PyTorch: quantized weights are
swapped in afterwards (layers/quantization.py), and which kernels run was chosen by the platform
when the layers were built (layers/custom_op.py); fast paths that replace this layer loop live in
the model runner.
"""
from __future__ import annotations

import itertools
from typing import ClassVar, Optional, Union

import torch
from torch import nn

from pagedllm.config import ModelArchConfig
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import MergedLinear
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.checkpoint_names import checkpoint_params
from pagedllm.models.pipeline import IntermediateTensors, holds_module


class SelfAttention(nn.Module):
    """Grouped-query self-attention: merged q/k/v projection, RoPE, paged attention, o_proj."""

    def __init__(self, cfg: ModelArchConfig, rope: Optional[RotaryEmbedding],
                 norm: type = RMSNorm, scale: Optional[float] = None,
                 sliding_window: Optional[int] = None, softcap: Optional[float] = None) -> None:
        """rope: None on a NoPE layer (SmolLM3); norm: the q/k norms' class; scale:
        head_dim ** -0.5 when None; sliding_window and softcap as Attention takes them."""
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (q, kv, kv), ("q_proj", "k_proj", "v_proj"),
                                     bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        # Qwen3: RMSNorm over head_dim, one weight shared by every head of q (of k)
        self.q_norm = norm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # shared with every layer; a list keeps it out of this module's children
        self.rope = None if rope is None else [rope]
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale,
                              sliding_window, softcap)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # a merged projection's outputs are strided views; the norm reads whole rows
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.rope is not None:
            q, k = self.rope[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(t, -1))  # [T, H]


def feed_forward(cfg: ModelArchConfig, index: int) -> nn.Module:
    """Layer `index`'s feed-forward block: routed experts on a sparse layer of a MoE model,
    else the SwiGLU MLP."""
    if cfg.is_sparse_layer(index):
        return SparseMoeBlock(cfg.hidden_size, cfg.moe)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size)


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP (or MoE) block, each with a residual."""

    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, None if index in cfg.nope_layers else rope,
                                       sliding_window=cfg.layer_window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, index)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the next norm adds
        them, in one fused op on the CPU."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embeddings, the layer stack and the final norm."""

    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        # an explicit (uninitialised) weight skips nn.Embedding's normal_() init, which on the
        # meta device goes through a decomposition that imports torch._dynamo (~1.5 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache."""

    decoder_cls: type = DecoderModel  # embeddings, layers and final norm (Gemma: its own)
    # what each module is to tensor parallelism (models/tensor_parallel.py); a module holding
    # weights outside these is refused there, not left whole
    tp_plan: ClassVar[dict[str, str]] = {
        "model.embed_tokens": "vocab",
        "lm_head": "vocab",
        "model.layers.*.self_attn": "attention",
        "model.layers.*.mlp": "feed_forward",  # a gated MLP, or a MoE block on a sparse layer
        "model.layers.*.*_layernorm": "replicated",
        "model.norm": "replicated",
    }

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings)
        self.model = self.decoder_cls(cfg, self.rope)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the layers this process runs: all of them, or a pipeline stage's (models/pipeline.py)
        self.layer_range = range(cfg.num_hidden_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, H] of tokens [T], in float32 whatever the weights' dtype: in
        bf16 its rounding error would flip near-tied greedy choices."""
        return self.model.embed_tokens(input_ids).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Optional[IntermediateTensors] = None
                ) -> Union[torch.Tensor, IntermediateTensors]:
        """Hidden states [T, H] for flattened tokens input_ids [T] at positions [T]; attention
        reads the step's metadata from the forward context. A pipeline stage after the first
        starts from the previous stage's `intermediate` instead of the tokens, and one before
        the last returns its stream as IntermediateTensors."""
        if intermediate is None:
            residual = self.embed(input_ids)  # [T, H]
            x = torch.zeros_like(residual)  # the first norm adds it: residual stays the embedding
        else:
            x, residual = intermediate
        r = self.layer_range
        for layer in itertools.islice(self.model.layers, r.start, r.stop):
            x, residual = layer(x, residual, positions)
        if r.stop < self.config.num_hidden_layers:
            return IntermediateTensors(x, residual)
        return self.model.norm(x, residual)[0]

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config ties them (and this
        process holds both: a last pipeline stage loads the head on its own)."""
        if self.config.tie_word_embeddings and holds_module(self.model.embed_tokens):
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, V] for hidden states [N, H]."""
        return self.lm_head(hidden)

    def greedy_head(self) -> nn.Module:
        """The module whose output compute_logits is, as it is (the head screen's)."""
        return self.lm_head

    def checkpoint_params(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor it loads into (models/checkpoint_names.py)."""
        return checkpoint_params(self)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama decoder with q/k/v biases (set by the config)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): the Llama decoder with per-head q/k RMSNorm (set by the config)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: the Llama decoder; its fused qkv_proj / gate_up_proj load into the same shards."""


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: Qwen2's decoder whose sparse layers route to experts, plus a gated shared
    expert (set by config.moe)."""


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's decoder whose sparse layers route to experts (set by config.moe)."""


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: the Llama decoder whose NoPE layers skip RoPE (set by config.nope_layers)."""
