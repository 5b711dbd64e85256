"""pagedllm: a vLLM-compatible LLM inference engine that runs on the device the machine has."""
import os as _os
import sys as _sys

# OpenMP threads waiting at a barrier spin GOMP_SPINCOUNT times (libgomp's default: 300,000)
# before they sleep. On a 2-vCPU machine two pagedllm processes then burn each other's cores:
# decode fell from 57-65 tok/s alone to 7-18 tok/s each with two at once; with 1,000 spins,
# 58-59 alone and 30-33 each (benchmarks/bench_sharing.py; batched throughput ~10% lower).
# libgomp reads it once, when torch loads it: set it before that, unless the user chose.
if ("torch" not in _sys.modules and "GOMP_SPINCOUNT" not in _os.environ
        and "OMP_WAIT_POLICY" not in _os.environ):
    _os.environ["GOMP_SPINCOUNT"] = "1000"
from pagedllm.outputs import (ClassificationOutput, ClassificationRequestOutput,
                              CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                              PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "model_path",
           "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
           "ScoringOutput", "ScoringRequestOutput", "LoRARequest", "__version__"]


def model_path(model: str = "qwen2.5-coder-0.5b-instruct") -> str:
    """The local path of a model: a shipped model's name (fetched once into the cache, then
    its folder: GGUF plus tokenizer files, which AutoTokenizer.from_pretrained reads), or an
    existing local path as it is. ValueError naming `model` otherwise."""
    from pagedllm.hub.model_store import resolve_model

    return resolve_model(model)


def __getattr__(name: str):
    # LLM pulls in torch; load it on first use so light imports stay light
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
