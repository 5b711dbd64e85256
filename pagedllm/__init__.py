"""pagedllm: a vLLM-compatible LLM inference engine that runs on the device the machine has."""
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; load it on first use so light imports stay light
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
