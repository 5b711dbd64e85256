"""Maps an architecture name (HF `architectures` entry or GGUF `general.architecture`) to a model class."""
from __future__ import annotations

import torch
from torch import nn

from typing import Optional

from pagedllm.config import ModelArchConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.layers.quantization import QuantPlan, swap_quantized_modules
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.bert import (BertForSequenceClassification, BertModel,
                                  XLMRobertaForSequenceClassification)
from pagedllm.models.decoder_classifier import with_classifier
from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.llama import (LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                   Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
                                   SmolLM3ForCausalLM)
from pagedllm.models.pipeline import keep_stage
from pagedllm.models.tensor_parallel import shard_model

_MODELS: dict[str, type[nn.Module]] = {
    "bert": BertModel,
    "bert_classifier": BertForSequenceClassification,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
    "xlm_roberta": BertModel,  # the same tensors; its config declares the departures
    "xlm_roberta_classifier": XLMRobertaForSequenceClassification,
}


def supported_architectures() -> list[str]:
    """Architecture keys that have a model class."""
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    """The model class for an architecture, or a ValueError listing the supported ones."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported "
                         f"architectures: {', '.join(supported_architectures())}") from None


def model_class_for(cfg: ModelArchConfig) -> type[nn.Module]:
    """The model class for cfg: its architecture's, with a last-token classification head for
    a decoder that has one (Qwen3ForSequenceClassification)."""
    cls = model_class(cfg.architecture)
    return with_classifier(cls) if cfg.classifier is not None and not cfg.is_encoder else cls


def build_model(cfg: ModelArchConfig, max_positions: int, dtype: torch.dtype,
                device: torch.device, quant_plan: Optional[QuantPlan] = None,
                stage: Optional[PipelineStage] = None,
                tp: Optional[TensorParallelRank] = None) -> nn.Module:
    """The model for cfg with parameters allocated in dtype on device but not initialised;
    modules named in quant_plan hold their weights in a GGML block format instead. With a
    pipeline stage, only the modules that stage holds (models/pipeline.py); with a tensor
    parallel rank, its share of every layer, and model.checkpoint_shards says which part of
    each checkpoint tensor it loads (models/tensor_parallel.py)."""
    cls = model_class_for(cfg)
    with torch.device("meta"):
        model = cls(cfg, max_positions)
        if stage is not None:
            keep_stage(model, stage)
        shards = {} if tp is None else shard_model(model, tp, quant_plan)
        if quant_plan:
            swap_quantized_modules(model, quant_plan, dtype)
    # torch.empty per tensor, as Module.to_empty does, but without its empty_like on meta
    # tensors: that runs through torch._refs in Python and imports sympy (~1 s of start-up)
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.checkpoint_shards = shards
    model.tie_weights()  # after the allocation, which gives each name its own tensor
    for module in model.modules():  # the RoPE tables (Gemma 3 has a second one)
        if isinstance(module, RotaryEmbedding):
            module.reset_tables(device)
    return model.eval()
