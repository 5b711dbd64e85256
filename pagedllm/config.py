"""Small configuration dataclasses shared by every layer of the engine."""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # the command line reads these dataclasses: config stays free of torch at run time
    import torch


# quantization= values: None picks "gguf" for a GGUF on the CPU, "bf16" (matrices kept in bf16
# for pagedllm's kernels) for a bf16 checkpoint with dtype="auto" on the CPU, "none" otherwise.
# the ones that quantize a float checkpoint as it loads (layers/quantization.py)
AT_LOAD_METHODS = ("int8", "int8_g128", "int4", "bf16")
QUANTIZATION_METHODS = ("gguf", *AT_LOAD_METHODS, "none")
# AsyncLLM's bound on the outputs (one per engine step) a stream holds that its caller has not
# taken (serve's --max-stream-backlog): a reader that keeps up holds one or two; 32 is a few
# seconds of a stalled client's steps and about 1 MB at worst
DEFAULT_MAX_STREAM_BACKLOG = 32


def check_quantization(value: Optional[str]) -> Optional[str]:
    """The quantization method, or a ValueError listing the allowed ones."""
    if value is None or value in QUANTIZATION_METHODS:
        return value
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                     f"got {value!r}")


def check_positive_int(name: str, value: Any, optional: bool = False) -> None:
    """A ValueError naming `name` unless `value` is an int > 0 (or None, when `optional`): the
    one check of every count and size option (EngineArgs and the configs built from it)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got "
                         f"{value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a sparse decoder (Qwen2-MoE, Qwen3-MoE): a softmax router picks
    num_experts_per_tok of num_experts SwiGLU experts for each token."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each routed expert's SwiGLU width
    norm_topk_prob: bool  # the chosen experts' probabilities rescaled to sum to 1
    # Qwen2-MoE: one SwiGLU expert every token runs, scaled by sigmoid(its own gate); None: none
    shared_expert_intermediate_size: Optional[int] = None
    # layers holding a plain SwiGLU MLP of the model's intermediate_size instead of experts
    # (mlp_only_layers, decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        shared = self.shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ValueError(f"shared_expert_intermediate_size must be >= 1 or None, got {shared}")

    def expert_params(self, hidden_size: int) -> int:
        """Parameters of one sparse layer's feed-forward block: router, experts, shared expert."""
        per_expert = 3 * hidden_size * self.moe_intermediate_size
        shared = self.shared_expert_intermediate_size
        shared_params = 0 if shared is None else 3 * hidden_size * shared + hidden_size
        return self.num_experts * (hidden_size + per_expert) + shared_params


@dataclass(frozen=True)
class GemmaConfig:
    """Where Gemma 2/3 depart from the Llama decoder: scaled embeddings, (1 + w) norms, four
    norms a layer, GeGLU, sliding-window layers, and (Gemma 2) soft-capped logits."""

    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    sliding_layers: tuple[int, ...]  # layers that attend over the last sliding_window tokens
    attn_logit_softcapping: Optional[float] = None  # scores -> tanh(s / cap) * cap; None: off
    final_logit_softcapping: Optional[float] = None
    rope_local_base_freq: Optional[float] = None  # Gemma 3: the sliding layers' RoPE base

    def __post_init__(self) -> None:
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_base_freq"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value}")


ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "relu")  # BERT hidden_act values the encoder runs
# what a classification head's logits go through: for a score (a cross-encoder's relevance)
# and for classify's probabilities
HEAD_ACTIVATIONS = ("sigmoid", "softmax", "identity")


@dataclass(frozen=True)
class ClassifierConfig:
    """A sequence-classification head (a cross-encoder, a reranker or a classifier): its labels
    (id2label order) and what its logits go through for a score and for classify's
    probabilities. A BERT encoder's reads the [CLS] row; a decoder's
    (Qwen3ForSequenceClassification) the last token's, and `from_tokens` builds it from the LM
    head's rows of those tokens (vLLM's classifier_from_token with from_2_way_softmax: weight =
    W[yes] - W[no], one label)."""

    labels: tuple[str, ...]
    score_activation: str = "sigmoid"
    classify_activation: str = "softmax"
    from_tokens: tuple[str, ...] = ()  # (false token, true token), as config.json names them
    token_ids: tuple[int, ...] = ()  # their ids, filled in from the tokenizer before loading

    @property
    def num_labels(self) -> int:
        """Outputs of the classification head."""
        return len(self.labels)

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("a classification head needs at least one label")
        for name in ("score_activation", "classify_activation"):
            if getattr(self, name) not in HEAD_ACTIVATIONS:
                raise ValueError(f"{name} must be one of {', '.join(HEAD_ACTIVATIONS)}, got "
                                 f"{getattr(self, name)!r}")
        if self.from_tokens and (len(self.from_tokens) != 2 or self.num_labels != 1):
            raise ValueError(f"from_tokens must name two tokens (false, true) of a one-label "
                             f"head, got {list(self.from_tokens)}")
        if self.token_ids and len(self.token_ids) != len(self.from_tokens):
            raise ValueError(f"token_ids {list(self.token_ids)} must be the ids of from_tokens "
                             f"{list(self.from_tokens)}")


@dataclass(frozen=True)
class EncoderConfig:
    """Where a BERT-family encoder departs from the decoder: bidirectional attention, learned
    absolute positions, token types, post-LayerNorm with biases and a plain (ungated) MLP.
    XLM-RoBERTa is the same encoder with its positions counted from padding_idx + 1 and no
    token types (its tokenizer gives none; every token reads type 0)."""

    type_vocab_size: int  # rows of the token-type (segment) embedding
    layer_norm_eps: float
    hidden_act: str  # one of ENCODER_ACTIVATIONS
    position_offset: int = 0  # the learned position row of token 0 (XLM-RoBERTa: pad id + 1)
    token_types: bool = True  # whether a pair's second text reads token type 1 (BERT's)

    def __post_init__(self) -> None:
        if self.type_vocab_size < 1:
            raise ValueError(f"type_vocab_size must be >= 1, got {self.type_vocab_size}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0, got {self.position_offset}")
        if not (math.isfinite(self.layer_norm_eps) and self.layer_norm_eps > 0):
            raise ValueError(f"layer_norm_eps must be a finite number > 0, got "
                             f"{self.layer_norm_eps}")
        if self.hidden_act not in ENCODER_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {', '.join(ENCODER_ACTIVATIONS)}, got "
                             f"{self.hidden_act!r}")


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape and hyper-parameters of a decoder-only checkpoint, however it was stored."""

    architecture: str  # registry key: "llama", "qwen2", "qwen3", "phi3", "smollm3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: Optional[dict[str, Any]] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: Optional[str] = None  # checkpoint dtype name, e.g. "bfloat16"
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # tokens a query may attend back over (itself included), or None: full attention
    sliding_window: Optional[int] = None
    # layers that attend over their whole context though sliding_window is set (Qwen2/Qwen3
    # below max_window_layers, SmolLM3's RoPE layers); Gemma names its own (gemma.sliding_layers)
    full_attention_layers: tuple[int, ...] = ()
    # RoPE turns the first rotary_dim values of each head (Phi-4-mini: 96 of 128); None: all
    rotary_dim: Optional[int] = None
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q and k RoPE leaves unturned
    moe: Optional[MoEConfig] = None  # routed experts (Qwen2-MoE, Qwen3-MoE); None: dense
    gemma: Optional[GemmaConfig] = None  # Gemma 2/3's departures; None: another family
    encoder: Optional[EncoderConfig] = None  # a BERT-family encoder; None: a decoder
    # a sequence-classification head (a pooling model that classifies and scores); None: none
    classifier: Optional[ClassifierConfig] = None
    # Matryoshka-trained: the first n values of an embedding are an embedding (dimensions=n);
    # is_matryoshka allows any n, matryoshka_dimensions names the trained ones (vLLM's keys)
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    is_matryoshka: bool = False

    def __post_init__(self) -> None:
        # the loaders refuse these by their checkpoint key and file; this guards every other way in
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings turn pairs of values), "
                             f"got {self.head_dim}")
        if self.rotary_dim is not None and not (
                0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in 2..head_dim ({self.head_dim}), "
                             f"got {self.rotary_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.moe is not None and not all(0 <= i < self.num_hidden_layers
                                            for i in self.moe.dense_layers):
            raise ValueError(f"moe.dense_layers {list(self.moe.dense_layers)} must be layer "
                             f"indices below num_hidden_layers ({self.num_hidden_layers})")
        if not all(0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)} must be layer indices "
                             f"below num_hidden_layers ({self.num_hidden_layers})")
        if self.gemma is not None and not all(0 <= i < self.num_hidden_layers
                                              for i in self.gemma.sliding_layers):
            raise ValueError(f"gemma.sliding_layers {list(self.gemma.sliding_layers)} must be "
                             f"layer indices below num_hidden_layers ({self.num_hidden_layers})")
        if self.gemma is not None and self.gemma.sliding_layers and self.sliding_window is None:
            raise ValueError("gemma.sliding_layers are set but sliding_window is None")
        if self.max_positions < 1:
            raise ValueError(f"max_position_embeddings ({self.max_position_embeddings}) must be "
                             f"larger than the encoder's position_offset "
                             f"({self.encoder.position_offset if self.encoder else 0})")
        if not all(0 <= i < self.num_hidden_layers for i in self.full_attention_layers):
            raise ValueError(f"full_attention_layers {list(self.full_attention_layers)} must be "
                             f"layer indices below num_hidden_layers ({self.num_hidden_layers})")

    def layer_window(self, index: int) -> Optional[int]:
        """The tokens layer `index` attends back over (itself included), or None: all of them."""
        if self.sliding_window is None:
            return None
        if self.gemma is not None:
            return self.sliding_window if index in self.gemma.sliding_layers else None
        return None if index in self.full_attention_layers else self.sliding_window

    @property
    def num_labels(self) -> int:
        """Outputs of the classification head (0: none; a pooling model then embeds)."""
        return 0 if self.classifier is None else self.classifier.num_labels

    @property
    def uses_token_types(self) -> bool:
        """Whether a text pair's second text is told apart by token type (a BERT encoder's);
        a decoder reads a pair as its tokens joined."""
        return self.encoder is not None and self.encoder.token_types

    @property
    def max_positions(self) -> int:
        """The longest input the learned or trained positions cover (XLM-RoBERTa's first
        padding_idx + 1 position rows are never a token's)."""
        offset = 0 if self.encoder is None else self.encoder.position_offset
        return self.max_position_embeddings - offset

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT family): it embeds, it does not generate."""
        return self.encoder is not None

    @property
    def has_window(self) -> bool:
        """Whether any layer attends over a sliding window only."""
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` routes its tokens to experts (else it has a plain MLP)."""
        return self.moe is not None and index not in self.moe.dense_layers

    @property
    def rope_dim(self) -> int:
        """The values of each head that RoPE turns."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def num_params(self) -> int:
        """Parameters of the decoder (or encoder) from its shapes."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.encoder is not None:  # q/k/v/o with biases, 2-matrix MLP, two LayerNorms a layer
            per_layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
            embed = (v + self.max_position_embeddings + self.encoder.type_vocab_size + 2) * h
            return embed + self.num_hidden_layers * per_layer
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.gemma is not None:  # the post-attention and pre/post-feedforward norms
            per_layer += 2 * h
        ffn = sum(self.moe.expert_params(h) if self.is_sparse_layer(n) else 3 * h * i
                  for n in range(self.num_hidden_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + head + self.num_hidden_layers * per_layer + ffn + h


RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("cls", "mean", "last")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a sequence's hidden states into one vector (sentence-
    transformers' Pooling and Normalize modules)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # L2-normalise the pooled vector by default (the Normalize module)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, how many blocks, prefix caching."""

    block_size: int = 16
    num_blocks: Optional[int] = None  # chosen by the memory planner (memory/plan.py)
    enable_prefix_caching: bool = True
    # the cache's dtype: None, the engine's compute dtype; torch.bfloat16 under float32 compute
    # on the CPU with kv_cache_dtype="bfloat16", or "auto" under bf16 weights
    # (config_builder.kv_cache_torch_dtype)
    dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)
        check_positive_int("num_blocks", self.num_blocks, optional=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    # a pooling request may be read in chunks over several steps (a decoder's last-token
    # pooling: causal attention keeps each chunk's keys and values); an encoder's may not
    chunked_pooling: bool = False
    # distinct LoRA adapters the running requests may use at once (the runner's slots); None:
    # LoRA is off
    max_loras: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("max_loras", self.max_loras, optional=True)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (enable_lora, vLLM's names): max_loras slots on the model, adapters of
    rank max_lora_rank at most, max_cpu_loras adapters kept read in memory (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept read in memory."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's methods pagedllm does not implement (yet): refused by name
_SPECULATIVE_NOT_YET = {
    "eagle": "EAGLE heads are not implemented", "eagle3": "EAGLE-3 heads are not implemented",
    "medusa": "Medusa heads are not implemented", "mlp_speculator": "MLP speculators are not "
    "implemented", "mtp": "multi-token-prediction layers are not implemented",
    "deepseek_mtp": "multi-token-prediction layers are not implemented",
}
_SPECULATIVE_FIELDS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "min_acceptance_rate"},
    "draft_model": {"method", "model", "num_speculative_tokens", "quantization", "dtype",
                    "revision", "draft_tensor_parallel_size", "min_acceptance_rate"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: propose num_speculative_tokens tokens per step and verify them
    in one forward pass. method "ngram": the proposal continues the latest earlier occurrence
    of the sequence's last n tokens (prompt_lookup_max >= n >= prompt_lookup_min), or of the
    request's predicted output (OpenAI's `prediction`). method "draft_model": a smaller model
    with the target's vocabulary (`model`, in its own quantization and dtype) proposes its
    greedy continuation."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # a request whose drafts are accepted less often than this (over its recent drafts), or
    # for which no draft length pays (core/spec_cost.py), stops speculating for a while: a
    # verify step that keeps nothing costs more than a decode step. 0: never stop, always
    # num_speculative_tokens (vLLM's behaviour)
    min_acceptance_rate: float = 0.25
    model: Optional[str] = None  # draft_model: the draft's name, path or GGUF
    quantization: Optional[str] = None  # draft_model: the draft's (None: as for any model)
    dtype: str = "auto"  # draft_model: the draft's dtype
    revision: Optional[str] = None  # draft_model: the draft's revision in the model store

    @classmethod
    def from_dict(cls, value: Any) -> "SpeculativeConfig":
        """speculative_config as LLM() or --speculative-config give it (vLLM's field names):
        unknown fields and methods refused by name; prompt_lookup_min/max default to each other
        (5 when neither is set), as vLLM's."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (a JSON object), got {value!r}")
        value = dict(value)
        method = value.get("method")
        if method is None and value.get("model") in ("ngram", "[ngram]"):
            method = value.pop("model")  # vLLM's older spelling: model="[ngram]"
        elif method is None and value.get("model") is not None:
            method = "draft_model"  # vLLM infers a draft model from a model path
        if method is None:
            raise ValueError("speculative_config.method is required: 'ngram' or 'draft_model'")
        if method in _SPECULATIVE_NOT_YET:
            raise ValueError(f"speculative_config.method={method!r} is not supported: "
                             f"{_SPECULATIVE_NOT_YET[method]}")
        if method in ("ngram", "[ngram]"):
            method = "ngram"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={method!r} is unknown; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        value["method"] = method
        known = _SPECULATIVE_FIELDS[method]
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config field(s) {', '.join(unknown)} are not "
                             f"supported with method {method!r}; supported: "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if method == "draft_model":
            return cls._draft_model(value)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        value["prompt_lookup_min"] = low if low is not None else (high if high is not None else 5)
        value["prompt_lookup_max"] = high if high is not None else value["prompt_lookup_min"]
        return cls(**value)

    @classmethod
    def _draft_model(cls, value: dict[str, Any]) -> "SpeculativeConfig":
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model is required with method 'draft_model': "
                             f"the draft model's name, directory or GGUF file, got {model!r}")
        tp = value.pop("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp!r} is not "
                             "supported: the draft runs on the target's one rank (1)")
        for name in ("quantization", "revision"):
            if value.get(name) is not None and not isinstance(value[name], str):
                raise ValueError(f"speculative_config.{name} must be a string, got "
                                 f"{value[name]!r}")
        dtype = value.get("dtype", "auto")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"speculative_config.dtype must be one of auto, float32, "
                             f"bfloat16, float16, got {dtype!r}")
        return cls(**value)

    @property
    def uses_draft_model(self) -> bool:
        """The drafts come from a draft model the runner runs (not from the scheduler)."""
        return self.method == "draft_model"

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"speculative_config.{name} must be a positive int, got "
                                 f"{value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"speculative_config.min_acceptance_rate must be in [0, 1), got "
                             f"{rate!r}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")
RAY_MISSING = ("distributed_executor_backend='ray' needs Ray, which is not installed: "
               "pip install 'pagedllm[ray]'")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run the model and how the engine reaches them (vLLM's option names).

    Pipeline parallelism splits the layers into contiguous stages; tensor parallelism splits
    every layer (heads, intermediate rows, vocabulary); both together run
    tensor_parallel_size x pipeline_parallel_size ranks, each its TP share of its stage's
    layers (vLLM's layout). One process per rank: a local process with "mp", a Ray actor with
    "ray"."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "mp" (one process per rank) with several ranks, "uni" (in-process) with one
    distributed_executor_backend: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} or None, got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in the engine's "
                             f"process; pipeline_parallel_size={self.pipeline_parallel_size} "
                             f"with tensor_parallel_size={self.tensor_parallel_size} needs 'mp' or "
                             "'ray'")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(RAY_MISSING)

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        """The executor backend in effect: "mp", "ray" or "uni"."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uni"

    def check_layers(self, num_hidden_layers: int) -> None:
        """A ValueError when there are more pipeline stages than layers to give them."""
        if self.pipeline_parallel_size > num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} is larger "
                             f"than the model's {num_hidden_layers} layers: each stage needs "
                             "at least one")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """What one request's output constraint may cost: caps on its spec checked before the
    grammar compiler sees it, the compile's time limit, the time of one step's mask, and the
    bytes of compiled grammars kept (docs/structured_outputs.md has the measurements)."""

    max_grammar_bytes: int = 256 * 1024  # a spec's UTF-8 bytes (schema JSON, grammar, regex, choices)
    max_grammar_rules: int = 2000  # rules of a Lark or GBNF grammar
    max_json_schema_nodes: int = 2000  # objects and arrays in a JSON schema
    max_guided_choices: int = 1000  # strings of a choice constraint
    grammar_compile_timeout: float = 10.0  # seconds one compile may take
    max_grammar_mask_ms: float = 25.0  # CPU ms one request's masks may take in one step
    grammar_cache_bytes: int = 256 * 1024**2  # estimated bytes of compiled grammars kept
    # a thinking model's tags (structured_output/reasoning.py): a constraint starts after the
    # thinking; None: no parser (the engine may pick one from the chat template)
    reasoning_parser: Optional[str] = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            raise ValueError(f"reasoning_parser must be a parser name, got "
                             f"{self.reasoning_parser!r}")
        for name in ("max_grammar_bytes", "max_grammar_rules", "max_json_schema_nodes",
                     "max_guided_choices", "grammar_cache_bytes"):
            check_positive_int(name, getattr(self, name))
        for name in ("grammar_compile_timeout", "max_grammar_mask_ms"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number, got {value!r}")


@runtime_checkable
class EnginePlatform(Protocol):
    """What the engine's parts ask of the platform they run on: pagedllm.platforms.Platform's
    interface, declared here because config sits below platforms (every Platform is one)."""

    name: str

    def device(self) -> torch.device: ...

    def supported_dtypes(self) -> tuple[torch.dtype, ...]: ...

    def memory(self) -> Any: ...  # a platforms.interface.MemoryInfo

    def init_device(self) -> None: ...

    def block_types(self) -> frozenset: ...

    def load_kernels(self) -> bool: ...

    @property
    def kernels_ready(self) -> bool: ...

    @property
    def kernels_error(self) -> Optional[str]: ...

    def op_impl(self, dtype: torch.dtype) -> str: ...

    def get_attn_backend(self, dtype: torch.dtype) -> str: ...

    def attention_backend(self, dtype: torch.dtype) -> str: ...

    def default_max_num_batched_tokens(self, intermediate_size: int, serving: bool) -> int: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to be built."""

    model_path: str
    arch: ModelArchConfig
    dtype: torch.dtype  # of activations, float weights and the KV cache
    platform: EnginePlatform  # a pagedllm.platforms.Platform
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    max_logprobs: int = 20  # vLLM's default
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # resolved: "gguf" (blocks kept), "int8", "int8_g128", "int4", "bf16" or "none"
    quantization: str = "none"
    # the kept GGUF blocks mapped, regrouped, from a cache file (page cache) instead of read
    # into anonymous memory (worker/x8_weight_file.py)
    mmap_weights: bool = False
    eos_token_ids: tuple[int, ...] = ()  # model, generation_config and tokenizer ids together
    # the Ray node each rank's memory was planned on (executor/ray_nodes.py), in global rank
    # order; the Ray executor puts each rank there. Empty: not planned per node
    rank_nodes: tuple[str, ...] = ()
    # seconds a step may take, plus its work at a floor speed (executor/deadline.py), before
    # the engine is declared hung; None or 0: steps are not timed
    step_timeout: Optional[float] = 30.0
    runner: str = "generate"  # "pooling": requests are embedded, never sampled
    pooler: Optional[PoolerConfig] = None  # set exactly when runner is "pooling"
    # vLLM's hf_overrides: config.json keys merged over the checkpoint's (arch is read with
    # them; every rank re-reads the checkpoint with them)
    hf_overrides: Optional[dict[str, Any]] = None
    lora: Optional[LoRAConfig] = None  # None: LoRA adapters are off (enable_lora=False)
    speculative: Optional[SpeculativeConfig] = None  # None: no speculative decoding
    # speculative method "draft_model": the draft model's own config (its model, dtype and
    # quantization; the target's platform, cache blocks and scheduler limits)
    draft: Optional["EngineConfig"] = None
    # greedy rows take the head's int8 screen (layers/head_screen.py); its bytes are planned
    head_screen: bool = False

    def __post_init__(self) -> None:
        self.parallel.check_layers(self.arch.num_hidden_layers)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if (self.runner == "pooling") != (self.pooler is not None):
            raise ValueError(f"runner={self.runner!r} with pooler={self.pooler!r}: a pooling "
                             "runner needs a pooler, a generate runner has none")
        if self.lora is not None and self.runner == "pooling":
            raise ValueError("enable_lora is not supported with a pooling runner: LoRA "
                             "adapters apply to generation only")
        if self.speculative is not None and self.runner == "pooling":
            raise ValueError("speculative_config is not supported with a pooling runner: it "
                             "speeds up generation only")

    @property
    def is_pooling(self) -> bool:
        """Requests are embedded (prefill only, pooled), never sampled."""
        return self.runner == "pooling"

    @property
    def device(self) -> torch.device:
        """The torch device the platform runs on."""
        return self.platform.device()
