"""EngineArgs: the user-facing engine options, with vLLM's names."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from pagedllm.config import ParallelConfig, StructuredOutputsConfig, check_quantization
from pagedllm.structured_output.reasoning import check_parser_name

if TYPE_CHECKING:  # the command line reads this module's tables: it stays free of torch
    import torch

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class IgnoredArg:
    """A vLLM option this engine takes and ignores with a warning: why, and how vLLM's command
    line spells its value."""

    why: str = "it has no effect on this engine"
    type: Optional[Callable[[str], Any]] = None  # None: an on/off switch (--x / --no-x)
    nargs: Optional[str] = None
    short: Optional[str] = None  # vLLM's short flag, e.g. -tp


_NO_GRAPHS = "the engine runs eagerly (no CUDA graphs)"
# vLLM options that tune GPUs or distributed execution; accepted and ignored here with a warning.
IGNORED_VLLM_ARGS: dict[str, IgnoredArg] = {
    "enforce_eager": IgnoredArg("the engine always runs eagerly"),
    "swap_space": IgnoredArg("preempted requests are recomputed, so no CPU swap space is "
                             "reserved", float),
    "cpu_offload_gb": IgnoredArg("weights stay on the device that runs them", float),
    "disable_custom_all_reduce": IgnoredArg("tensor parallelism all-reduces through "
                                            "torch.distributed (gloo on the CPU); there is no "
                                            "custom all-reduce to turn off"),
    "max_seq_len_to_capture": IgnoredArg(_NO_GRAPHS, int),
    "cuda_graph_sizes": IgnoredArg(_NO_GRAPHS, int, nargs="+"),
    "compilation_config": IgnoredArg("the model is not compiled", str, short="-O"),
    "kv_cache_dtype": IgnoredArg("the KV cache is kept in the model's dtype", str),
    "disable_log_stats": IgnoredArg("LLM() logs no periodic statistics"),
    "tokenizer_mode": IgnoredArg("the tokenizer is always a fast (Rust) tokenizer", str),
    "load_format": IgnoredArg("the format is read from the checkpoint (GGUF or safetensors)",
                              str),
    "download_dir": IgnoredArg("downloads go to the Hugging Face cache (HF_HUB_CACHE)", str),
    "tokenizer_revision": IgnoredArg("the tokenizer comes from the model's revision", str),
    "enable_chunked_prefill": IgnoredArg("long prompts are always prefilled in chunks"),
    "disable_async_output_proc": IgnoredArg(),
    "worker_cls": IgnoredArg("every rank runs pagedllm's own worker", str),
    "hf_overrides": IgnoredArg("the checkpoint's config is used as it is", str),
    "mm_processor_kwargs": IgnoredArg("the engine runs text-only models", str),
    "limit_mm_per_prompt": IgnoredArg("the engine runs text-only models", str),
    "num_scheduler_steps": IgnoredArg("the scheduler plans one step at a time", int),
}

USAGE_CONTEXTS = ("llm", "api_server")
RUNNER_CHOICES = ("auto", "generate", "pooling")  # vLLM's --runner
# vLLM's older --task values -> the runner each implies; others are refused by name
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling"}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float", "half")  # as vLLM's --dtype
DEVICE_HELP = "auto, cpu, cuda (or cuda:N), rocm, xpu or mps; auto takes the first usable"


def warn_ignored(name: str, value: Any) -> None:
    """The one warning for a vLLM option that is taken and ignored (LLM() and `serve` alike)."""
    logger.warning("%s=%r is ignored: %s", name, value, IGNORED_VLLM_ARGS[name].why)


def add_ignored_cli_args(parser: argparse.ArgumentParser,
                         exclude: frozenset[str] = frozenset()) -> None:
    """vLLM's flags for IGNORED_VLLM_ARGS (but `exclude`), in a group of their own; a flag
    left out stays None."""
    group = parser.add_argument_group(
        "vLLM options accepted and ignored", "taken so that vLLM command lines run; each one "
        "given logs a warning saying why it has no effect here")
    for name, arg in IGNORED_VLLM_ARGS.items():
        if name in exclude:
            continue
        flags = ["--" + name.replace("_", "-")] + ([arg.short] if arg.short else [])
        kind = dict(action=argparse.BooleanOptionalAction) if arg.type is None else dict(
            type=arg.type, nargs=arg.nargs)
        group.add_argument(*flags, dest=name, default=None, help=f"ignored: {arg.why}", **kind)


def ignored_cli_values(args: argparse.Namespace,
                       exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The IGNORED_VLLM_ARGS (but `exclude`, as given to add_ignored_cli_args) set on the
    command line, by name (for EngineArgs.from_kwargs)."""
    return {name: getattr(args, name) for name in IGNORED_VLLM_ARGS
            if name not in exclude and getattr(args, name, None) is not None}


_SO = StructuredOutputsConfig()  # the defaults of the structured-output limits
# the help of each structured-output limit (the field names of StructuredOutputsConfig)
STRUCTURED_OUTPUT_HELP: dict[str, str] = {
    "max_grammar_bytes": "largest constraint a request may send, in UTF-8 bytes (a JSON "
                         "schema's text, a grammar, a regex, the choices together)",
    "max_grammar_rules": "most rules in a Lark or GBNF grammar",
    "max_json_schema_nodes": "most objects and arrays in a JSON schema",
    "max_guided_choices": "most strings in a choice constraint (guided_choice)",
    "grammar_compile_timeout": "seconds a constraint may take to compile; a longer one is "
                               "refused (HTTP 400)",
    "max_grammar_mask_ms": "CPU milliseconds one request's allowed-token masks (all its n "
                           "samples) may take in one step; a request over it is stopped with "
                           "an error, so that it cannot slow the others' steps",
    "grammar_cache_bytes": "estimated bytes of compiled grammars kept for reuse",
}


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the structured-output limits (--max-grammar-bytes, ...), in a group."""
    group = parser.add_argument_group("structured outputs", "what one request's constraint may "
                                      "cost; each refusal names its limit")
    for name, text in STRUCTURED_OUTPUT_HELP.items():
        default = getattr(_SO, name)
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=type(default),
                           default=default, help=text)


def structured_output_values(args: argparse.Namespace) -> dict[str, Any]:
    """The structured-output limits parsed by add_structured_output_args, by field name."""
    return {name: getattr(args, name) for name in STRUCTURED_OUTPUT_HELP}


@dataclass
class EngineArgs:
    """Options for building an engine; LLM(...) keyword arguments map onto these fields."""

    model: str
    tokenizer: Optional[str] = None
    dtype: Union[str, torch.dtype] = "auto"
    device: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None  # vLLM's name; here: number of KV blocks
    gpu_memory_utilization: Optional[float] = None  # GPU only: share of free device memory to use
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    trust_remote_code: bool = False
    revision: Optional[str] = None  # Hub branch, tag or commit
    gguf_file: Optional[str] = None  # a .gguf file inside a Hub repo
    model_source: Optional[str] = None  # None (Hugging Face, or env), "huggingface", "modelscope"
    # None: a GGUF keeps its quantized blocks on the CPU, a bf16 checkpoint with dtype "auto"
    # its bf16 matrices ("bf16"); "gguf", "int8", "int4", "bf16" or "none"
    quantization: Optional[str] = None
    # a GGUF's kept blocks mapped, regrouped, from a cache file (page cache) instead of read into
    # memory: None maps them only when they do not fit in memory; True always; False never
    mmap_weights: Optional[bool] = None
    # ranks: the layers split into pipeline_parallel_size stages, or every layer split over
    # tensor_parallel_size ranks; one process each ("mp") or one Ray actor each ("ray"); both
    # at once are refused
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None  # None: "mp" with several ranks
    # who drives the engine, as vLLM's UsageContext: "llm" (offline LLM class) or "api_server";
    # it picks the default token budget (a server keeps steps short for time to first token)
    usage_context: str = "llm"
    # seconds a step may take, plus its work at a floor speed (executor/deadline.py: 195 s
    # more for a 256-token prefill chunk of a 7B), before the engine is declared hung (a rank
    # stopped, a kernel stuck): the requests fail and a server exits 1; None or 0: no deadline
    step_timeout: Optional[float] = 30.0
    # structured outputs: caps on a request's constraint, checked before it is compiled (each
    # refusal names its cap), the compile's time limit, one mask's CPU time, the grammar cache
    max_grammar_bytes: int = _SO.max_grammar_bytes
    max_grammar_rules: int = _SO.max_grammar_rules
    max_json_schema_nodes: int = _SO.max_json_schema_nodes
    max_guided_choices: int = _SO.max_guided_choices
    grammar_compile_timeout: float = _SO.grammar_compile_timeout
    max_grammar_mask_ms: float = _SO.max_grammar_mask_ms
    grammar_cache_bytes: int = _SO.grammar_cache_bytes
    # a thinking model's reasoning parser (qwen3, deepseek_r1): structured outputs start after
    # the thinking, and the server splits it from the answer; None: picked from the chat template
    reasoning_parser: Optional[str] = None
    # "pooling": the model embeds (LLM.embed, /v1/embeddings); "generate": it completes;
    # "auto": pooling for an encoder (BERT), generate otherwise (vLLM's --runner)
    runner: str = "auto"
    task: Optional[str] = None  # vLLM's older spelling: "embed" is runner "pooling"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Split keyword arguments into ours, ignored vLLM ones (warned and dropped) and unknown
        ones (TypeError)."""
        known = {f.name for f in fields(cls)}
        ours = {}
        for key, value in kwargs.items():
            if key in known:
                ours[key] = value
            elif key in IGNORED_VLLM_ARGS:
                warn_ignored(key, value)
            else:
                raise TypeError(f"unexpected keyword argument {key!r}; supported: "
                                f"{', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **ours)

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        self.parallel_config()  # a ValueError naming the field
        self.structured_outputs_config()
        check_parser_name(self.reasoning_parser)
        for name in ("max_num_seqs", "block_size", "max_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        gmu = self.gpu_memory_utilization
        if gmu is not None and (isinstance(gmu, bool) or not isinstance(gmu, (int, float))
                                or not 0 < gmu <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        if self.model_source not in (None, "huggingface", "modelscope"):
            raise ValueError("model_source must be 'huggingface' or 'modelscope', got "
                             f"{self.model_source!r}")
        if self.mmap_weights is not None and not isinstance(self.mmap_weights, bool):
            raise ValueError(f"mmap_weights must be True, False or None, got {self.mmap_weights!r}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got "
                             f"{self.usage_context!r}")
        timeout = self.step_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout >= 0):
            raise ValueError(f"step_timeout must be a number of seconds >= 0 (0: no deadline) "
                             f"or None, got {timeout!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.runner not in RUNNER_CHOICES:
            raise ValueError(f"runner must be one of {', '.join(RUNNER_CHOICES)}, got "
                             f"{self.runner!r}")
        self.resolved_runner()

    def resolved_runner(self) -> str:
        """runner, with task (vLLM's older option) folded in; a ValueError naming task for a
        value not implemented or one that contradicts runner."""
        if self.task is None:
            return self.runner
        if self.task not in TASK_RUNNERS:
            raise ValueError(f"task={self.task!r} is not supported; supported: "
                             f"{', '.join(TASK_RUNNERS)} (or runner=...)")
        implied = TASK_RUNNERS[self.task]
        if self.runner not in ("auto", implied) and implied != "auto":
            raise ValueError(f"task={self.task!r} means runner={implied!r}, but runner="
                             f"{self.runner!r} was given")
        return self.runner if implied == "auto" else implied

    def parallel_config(self) -> ParallelConfig:
        """The ranks asked for, checked."""
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                              self.distributed_executor_backend)

    def structured_outputs_config(self) -> StructuredOutputsConfig:
        """The structured-output limits asked for, checked."""
        return StructuredOutputsConfig(**{f.name: getattr(self, f.name)
                                          for f in fields(StructuredOutputsConfig)})
