"""The captured decode step: every decoder layer of a decode-only step in one C++ call
(kernels/csrc/decode_stack.cpp), where the model's weights are all x8 matrices on the CPU: a
GGUF's kept blocks, or a float checkpoint's bf16 matrices (quantization="bf16", ggml type BF16,
which linear_x8 hands to the bf16 kernels).

At one token a step, the Python between a layer's ops (module calls, views, ~25 dispatched ops)
costs about a third of the layer's matmuls. The stack runs the same kernels in the same order
without it, so its numbers equal the layer loop's (tested). It replaces the model's layer loop
for steps in which every request adds one token; it is the slot where CUDA-graph replay will sit
on a GPU. Steps with a prompt chunk run the model's loop.

It takes every dense layer shape the models have: q/k/v biases (Qwen2), per-head q/k norms
(Qwen3, Gemma 3), sliding windows (Mistral, Qwen2/3, Phi-3, Gemma), soft-capped attention
(Gemma 2), Gemma's (1 + w) norms (the 1 added at capture) and its post-attention / post-FFN
norms, GeGLU, query_pre_attn_scalar (the attention's scale), one RoPE table per layer (Gemma 3's
local and global ones), NoPE layers (SmolLM3), partial rotary and LongRoPE (Phi: in the tables),
and routed experts in place of the MLP (Qwen2-MoE, Qwen3-MoE: the op layers/moe.py calls for x8
experts, kernels/csrc/moe.cpp).

Whether a model takes it is decided once, at load (decide()), with the reason the kernels log
line gives; the step itself checks nothing.

LoRA: take_lora() hands the stack each projection's LoRALinear slot tensors (shared, so loading
an adapter into a slot changes what the stack reads); a step with adapters then passes each
row's slot, and the stack adds the deltas with the op LoRALinear.forward_cpu calls.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.activation import GeluTanhAndMul
from pagedllm.layers.ggml_linear import GGMLLinear, GGMLMergedLinear
from pagedllm.layers.lora import LoRALinear
from pagedllm.layers.moe import SparseMoeBlock, x8_mlp_args
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.models.pipeline import IntermediateTensors


def _packed(*modules: nn.Module) -> bool:
    return all(isinstance(m, (GGMLLinear, GGMLMergedLinear)) and m.packed for m in modules)


def _float32(*tensors: Optional[torch.Tensor]) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


# Registry keys whose decoder layers the C++ stack reproduces op for op: the Llama layer (Llama,
# Mistral, Qwen2, Qwen3, Phi-3 once its fused tensors are split, SmolLM3; with routed experts,
# Qwen2-MoE and Qwen3-MoE) and Gemma 2/3's.
STACK_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen2_moe", "qwen3",
                       "qwen3_moe", "smollm3")


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The scale the C++ norm multiplies by: Gemma's 1 + w, added as its forward_cpu adds it."""
    return norm.weight + 1.0 if isinstance(norm, GemmaRMSNorm) else norm.weight


def _norms(layer: nn.Module) -> list[torch.Tensor]:
    """The pre-attention and pre-FFN norms, then Gemma's post-attention and post-FFN ones."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: four norms a layer
        mods = (layer.input_layernorm, layer.pre_feedforward_layernorm,
                layer.post_attention_layernorm, layer.post_feedforward_layernorm)
    else:
        mods = (layer.input_layernorm, layer.post_attention_layernorm)
    return [_norm_weight(m) for m in mods]


def _layer_args(layer: nn.Module, rope_index: dict[int, int]) -> Optional[tuple]:
    """DecodeStack.add_layer() arguments for a decoder layer whose weights are all x8 blocks
    and whose norms and biases are float32, or None; rope_index maps each RoPE table module (by
    id) to its index in the stack. A routed-experts layer gives q, k, v, o only."""
    attn, mlp = layer.self_attn, layer.mlp
    moe = isinstance(mlp, SparseMoeBlock)
    ffn = ([], []) if moe else x8_mlp_args(mlp, gelu=True)
    if ffn is None:
        return None
    qkv = attn.qkv_proj
    if not _packed(qkv, attn.o_proj) or attn.o_proj.bias is not None:
        return None
    norms = _norms(layer)
    qk_norms = [] if attn.q_norm is None else [_norm_weight(attn.q_norm),
                                               _norm_weight(attn.k_norm)]
    if not _float32(qkv.bias, *norms, *qk_norms):
        return None
    biases = [] if qkv.bias is None else list(qkv.bias.split(qkv.output_sizes))
    weights = [*qkv.weights, attn.o_proj.weight, *ffn[0]]
    qtypes = [*(int(t) for t in (*qkv.qtypes, attn.o_proj.qtype)), *ffn[1]]
    rope = -1 if attn.rope is None else rope_index[id(attn.rope[0])]
    a = attn.attn
    return (weights, qtypes, biases, qk_norms, norms, rope, a.sliding_window or 0,
            float(a.softcap or 0.0), not moe and isinstance(mlp.act, GeluTanhAndMul))


def _own_layers(model: nn.Module) -> Optional[list[nn.Module]]:
    """The decoder layers of the model (a pipeline stage's own: model.layer_range), in order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    r = model.layer_range
    return list(itertools.islice(layers, r.start, r.stop))


class DecodeChoice(NamedTuple):
    """What runs decode-only steps: the captured stack, or None for the model's layer loop,
    and why (for the kernels log line)."""

    captured: Optional["CapturedDecode"]
    why: str


def decide(model: nn.Module, kernels_ready: bool) -> DecodeChoice:
    """The captured step where the model can take it, else the layer loop, with the reason."""
    arch = model.config.architecture
    if arch not in STACK_ARCHITECTURES:
        return DecodeChoice(None, f"the model's layer loop (the C++ decode stack does not run "
                                  f"{arch} layers)")
    if not kernels_ready:
        return DecodeChoice(None, "the model's layer loop (no compiled CPU kernels)")
    captured = CapturedDecode.capture(model, kernels_ready)
    if captured is None:
        return DecodeChoice(None, "the model's layer loop (the C++ decode stack takes only x8 "
                                  "block or bf16 matrices with float32 norms on the CPU)")
    return DecodeChoice(captured, f"the C++ decode stack ({arch} layers, one call a step)")


class CapturedDecode:
    """embed -> the C++ layer stack -> final norm, for decode-only steps; on a pipeline stage,
    its own layers only, from and to the residual stream of the stages around it."""

    def __init__(self, model: nn.Module, stack) -> None:
        self.model, self.stack = model, stack

    @classmethod
    def capture(cls, model: nn.Module, kernels_ready: bool) -> Optional["CapturedDecode"]:
        """The captured step of a model whose layers can all take it, else None."""
        layers = _own_layers(model)
        if (not kernels_ready or not layers
                or model.config.architecture not in STACK_ARCHITECTURES):
            return None
        # each distinct table once, in the order the layers first use them
        ropes = {id(r): r for r in (lay.self_attn.rope[0] for lay in layers
                                    if lay.self_attn.rope is not None)}
        rope_index = {key: i for i, key in enumerate(ropes)}
        tables = list(ropes.values()) or [model.rope]  # the stack wants one even if no layer turns
        attn, norm = layers[0].self_attn, layers[0].input_layernorm
        if not _float32(*(t.cos for t in tables), *(t.sin for t in tables)):
            return None
        # one scale and eps for the stack: every family's layers share them
        if any(lay.self_attn.attn.scale != attn.attn.scale or lay.input_layernorm.eps != norm.eps
               for lay in layers):
            return None
        args = [_layer_args(layer, rope_index) for layer in layers]
        moes = {i: layer.mlp.x8_args() for i, layer in enumerate(layers)
                if isinstance(layer.mlp, SparseMoeBlock)}
        if any(a is None for a in args) or any(m is None for m in moes.values()):
            return None
        stack = torch.classes.pagedllm.DecodeStack(attn.num_heads, attn.num_kv_heads,
                                                   attn.head_dim, norm.eps, attn.attn.scale,
                                                   tables[0].cos, tables[0].sin)
        for table in tables[1:]:
            stack.add_rope(table.cos, table.sin)
        for a in args:
            stack.add_layer(*a)
        for i, m in moes.items():
            stack.set_moe(i, *m)
        return cls(model, stack)

    def take_lora(self) -> bool:
        """Give the stack the LoRA slots of the model's wrapped projections (after
        lora_slots.wrap_projections); False, giving none, unless every one of them adds its
        deltas with the C++ op (forward_cpu), which the stack's numbers must equal."""
        per_layer = [(lay.self_attn.qkv_proj, lay.self_attn.o_proj,
                      getattr(lay.mlp, "gate_up_proj", None), getattr(lay.mlp, "down_proj", None))
                      for lay in _own_layers(self.model)]  # routed experts carry no LoRA
        wrappers = [m for mods in per_layer for m in mods if isinstance(m, LoRALinear)]
        if not wrappers or any(w.impl != "cpu" for w in wrappers):
            return False
        for i, mods in enumerate(per_layer):
            for projection, m in enumerate(mods):  # the stack's order: q/k/v, o, gate/up, down
                if isinstance(m, LoRALinear):
                    self.stack.set_lora(i, projection, m.a, m.bt, m.rank_table)
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, intermediate: Optional[IntermediateTensors] = None,
                 lora_slots: Optional[torch.Tensor] = None
                 ) -> Union[torch.Tensor, IntermediateTensors]:
        """Hidden states [B, H] of a decode-only step, as model(input_ids, positions,
        intermediate) gives (IntermediateTensors on a pipeline stage before the last);
        lora_slots: each row's LoRA slot (-1: none), or None (after take_lora())."""
        if intermediate is None:
            residual = self.model.embed(input_ids)  # [B, H] float32
            x = torch.zeros_like(residual)
        else:
            x, residual = intermediate
        dec = meta.decode
        x, residual = self.stack.forward(x, residual, positions, kv_cache, meta.slot_mapping,
                                         dec.block_table, dec.context_lens, lora_slots)
        if self.model.layer_range.stop < self.model.config.num_hidden_layers:
            return IntermediateTensors(x, residual)
        return self.model.model.norm(x, residual)[0]
