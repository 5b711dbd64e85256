"""EngineArgs: the user-facing engine options, with vLLM's names."""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from pagedllm.config import (DISTRIBUTED_EXECUTOR_BACKENDS, QUANTIZATION_METHODS, CacheConfig,
                             EngineConfig, LoRAConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig,
                             StructuredOutputsConfig, check_positive_int, check_quantization)
from pagedllm.structured_output.reasoning import PARSERS as REASONING_PARSERS, check_parser_name

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
    "disable_log_stats": IgnoredArg("LLM() logs no periodic statistics"),
    "tokenizer_mode": IgnoredArg("the tokenizer is always a fast (Rust) tokenizer", str),
    "load_format": IgnoredArg("the format is read from the checkpoint (GGUF or safetensors)",
                              str),
    "download_dir": IgnoredArg("downloads go to the Hugging Face cache (HF_HUB_CACHE)", str),
    "tokenizer_revision": IgnoredArg("the tokenizer comes from the model's revision", str),
    "enable_chunked_prefill": IgnoredArg("long prompts are always prefilled in chunks"),
    "disable_async_output_proc": IgnoredArg(),
    "worker_cls": IgnoredArg("every rank runs pagedllm's own worker", str),
    "mm_processor_kwargs": IgnoredArg("the engine runs text-only models", str),
    "limit_mm_per_prompt": IgnoredArg("the engine runs text-only models", str),
    "num_scheduler_steps": IgnoredArg("the scheduler plans one step at a time", int),
}

USAGE_CONTEXTS = ("llm", "api_server")
RUNNER_CHOICES = ("auto", "generate", "pooling")  # vLLM's --runner
# vLLM's older --task values -> the runner each implies; others are refused by name
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling"}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float", "half")  # as vLLM's --dtype
# vLLM's --kv-cache-dtype values and the float dtypes' names (config_builder.kv_cache_torch_dtype
# takes "auto", the compute dtype's name, and bfloat16 under float32 compute on the CPU)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
MODEL_SOURCES = ("huggingface", "modelscope")
DEVICE_HELP = "auto, cpu, cuda (or cuda:N), rocm, xpu or mps; auto takes the first usable"


def cli_fields(names: Optional[Sequence[str]] = None) -> list[Field]:
    """The EngineArgs fields that are flags (those with a help text), or those in `names`."""
    flags = [f for f in fields(EngineArgs) if "help" in f.metadata]
    if names is None:
        return flags
    unknown = set(names) - {f.name for f in flags}
    assert not unknown, f"not EngineArgs flags: {sorted(unknown)}"
    return [f for f in flags if f.name in names]


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


_LORA = LoRAConfig()  # vLLM's defaults of the LoRA options
_LORA_GROUP = ("LoRA adapters",
               "PEFT (or llama.cpp GGUF) LoRA adapters over the base model (docs/lora.md)")


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (--hf-overrides '{"key": value}'), or argparse's error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def check_hf_overrides(value: Any) -> Optional[dict[str, Any]]:
    """hf_overrides as a dict of config.json keys (None: none), or a ValueError naming the
    field; vLLM's callable form needs transformers' config object, which is not built here."""
    if value is None:
        return None
    if callable(value):
        raise ValueError("hf_overrides as a function is not supported: pass a dict of "
                         "config.json keys")
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"hf_overrides must be a dict of config.json keys, got {value!r}")
    return dict(value) or None


_SO = StructuredOutputsConfig()  # the defaults of the structured-output limits
_SO_GROUP = ("structured outputs", "what one request's constraint may cost; each refusal names "
             "its limit")


def _opt(default: Any, help: str, *, type: Optional[Callable[[str], Any]] = None,
         choices: Optional[Sequence[str]] = None, short: Optional[str] = None,
         metavar: Optional[str] = None, action: Optional[str] = None,
         group: Optional[tuple[str, str]] = None) -> Any:
    """An EngineArgs field that is also a command-line flag: its help, argparse type (default:
    the default's type, str for None), choices, vLLM's short flag, and its help group."""
    return field(default=default, metadata=dict(help=help, type=type, choices=choices,
                                                short=short, metavar=metavar, action=action,
                                                group=group))


def _so(name: str, help: str) -> Any:
    """A structured-output limit: its default is StructuredOutputsConfig's."""
    return _opt(getattr(_SO, name), help, group=_SO_GROUP)


@dataclass
class EngineArgs:
    """Options for building an engine; LLM(...) keyword arguments map onto these fields, and
    every field with a help text is a flag of each command that starts an engine (serve, bench,
    chat and complete without --url, run)."""

    model: str
    tokenizer: Optional[str] = _opt(None, "a tokenizer directory or Hub id (default: the "
                                    "model's)")
    revision: Optional[str] = _opt(None, "Hub branch, tag or commit (default: main)")
    gguf_file: Optional[str] = _opt(None, "a .gguf file inside a Hub repo (default: the one the "
                                    "repo's files or a ':TAG' suffix pick)")
    # None: Hugging Face, or ModelScope when PAGEDLLM_USE_MODELSCOPE=1
    model_source: Optional[str] = _opt(
        None, "where Hub ids are fetched from (default: huggingface, or modelscope when "
        "PAGEDLLM_USE_MODELSCOPE=1)", choices=MODEL_SOURCES)
    dtype: Union[str, torch.dtype] = _opt("auto", "compute dtype; auto picks per device and "
                                          "checkpoint", choices=DTYPE_CHOICES)
    device: str = _opt("auto", DEVICE_HELP, metavar="DEVICE")
    kv_cache_dtype: str = _opt("auto", "the KV cache's dtype: auto (the dtype the model computes "
                               "in; bf16 under bf16 weights on the CPU, as vLLM's auto), the "
                               "compute dtype's name (float32: a float32 cache under bf16 "
                               "weights too), or bfloat16 where that is float32 on the CPU (half "
                               "the cache's memory and the bytes decode attention reads; K/V "
                               "rounded to bf16); another, fp8 included, is refused",
                               metavar="DTYPE")
    # None: a GGUF keeps its quantized blocks on the CPU, a bf16 checkpoint with dtype "auto"
    # its bf16 matrices ("bf16"); "gguf", "int8", "int8_g128", "int4", "bf16" or "none"
    quantization: Optional[str] = _opt(
        None, "default: a GGUF keeps its quantized blocks on the CPU, a bf16 checkpoint with "
        "dtype auto its bf16 matrices (bf16); int8/int8_g128/int4 quantize a float checkpoint at "
        "load (int8: Q8_0, a scale per 32 values; int8_g128: a scale per 128, faster prompts); "
        "none dequantizes", choices=QUANTIZATION_METHODS)
    # a GGUF's kept blocks mapped, regrouped, from a cache file (page cache) instead of read into
    # memory: None maps them only when they do not fit in memory; True always; False never
    mmap_weights: Optional[bool] = _opt(
        None, "map a GGUF's kept blocks, regrouped, from a cache file (page cache) instead of "
        "reading them into memory (default: only when they do not fit)",
        action="BooleanOptionalAction")
    max_model_len: Optional[int] = _opt(None, "longest prompt + output (default: the model's, "
                                        "shrunk to what memory holds)", type=int)
    max_num_seqs: int = _opt(SchedulerConfig.max_num_seqs, "most sequences in a batch")
    max_num_batched_tokens: Optional[int] = _opt(
        None, "most tokens one step computes (default: chosen per device for short steps)",
        type=int)
    block_size: int = _opt(CacheConfig.block_size, "tokens per KV-cache block")
    enable_prefix_caching: bool = _opt(CacheConfig.enable_prefix_caching, "reuse the KV blocks of "
                                       "prompt prefixes already computed",
                                       action="BooleanOptionalAction")
    kv_cache_memory_bytes: Optional[int] = _opt(
        None, "bytes for the KV cache (default: sized from the memory available)", type=int)
    # vLLM's name; here: the number of KV blocks on any device
    num_gpu_blocks_override: Optional[int] = _opt(
        None, "number of KV-cache blocks on any device (default: sized from memory)", type=int)
    gpu_memory_utilization: Optional[float] = _opt(
        None, "share of free GPU memory to plan with (default: the platform's; no effect on "
        "the CPU)", type=float)
    max_logprobs: int = _opt(EngineConfig.max_logprobs, "most logprobs a request may ask for")
    seed: int = _opt(EngineConfig.seed, "seed of the sampling generators")
    trust_remote_code: bool = _opt(False, "let the tokenizer run code from the model's repo",
                                   action="store_true")
    # vLLM's: config.json keys merged over the checkpoint's before it is read (Qwen3-Reranker:
    # architectures, classifier_from_token, is_original_qwen3_reranker); a key nothing reads
    # for the model is refused by name
    hf_overrides: Optional[dict[str, Any]] = _opt(
        None, "a JSON object of config.json keys merged over the checkpoint's, e.g. "
        "Qwen3-Reranker's '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": "
        "true}'; a key pagedllm does not read is refused (default: none, config.json as it is)",
        type=_json_object, metavar="JSON")
    # ranks: the layers split into pipeline_parallel_size stages and every layer of a stage
    # split over tensor_parallel_size ranks (tp x pp ranks in all); one process each ("mp") or
    # one Ray actor each ("ray")
    pipeline_parallel_size: int = _opt(ParallelConfig.pipeline_parallel_size, "split the layers "
                                       "into this many stages, one process each", short="-pp")
    tensor_parallel_size: int = _opt(ParallelConfig.tensor_parallel_size, "ranks each layer is "
                                     "split over, one process (or Ray actor) each; with -pp, in "
                                     "every stage", short="-tp")
    distributed_executor_backend: Optional[str] = _opt(
        None, "mp: one process per rank on this machine; ray: one Ray actor per rank on the "
        "Ray cluster at RAY_ADDRESS (else a local one; needs pagedllm[ray]); uni: the model in "
        "this process (default: mp with several ranks, else uni)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    # who drives the engine, as vLLM's UsageContext: "llm" (offline LLM class) or "api_server";
    # it picks the default token budget (a server keeps steps short for time to first token)
    usage_context: str = "llm"
    # executor/deadline.py: the floor speed, and 195 s more for a 256-token prefill chunk of a 7B
    step_timeout: Optional[float] = _opt(
        EngineConfig.step_timeout, "seconds a step may take, plus its work at 20 GFLOP/s "
        "(195 s more for a 256-token prefill of a 7B), before the engine is declared hung (a "
        "rank stopped, a kernel stuck): the requests fail, and a server answers /health with "
        "503 and the reason and exits 1 (0: no deadline)", type=float)
    # "pooling": the model embeds (LLM.embed, /v1/embeddings); "generate": it completes;
    # "auto": pooling for an encoder (BERT), generate otherwise (vLLM's --runner)
    runner: str = _opt("auto", "pooling: the model embeds (/v1/embeddings); generate: it "
                       "completes; auto: pooling for an encoder (BERT), generate otherwise",
                       choices=RUNNER_CHOICES)
    task: Optional[str] = _opt(None, "vLLM's older spelling of --runner: embed is --runner "
                               "pooling (default: none, --runner decides)",
                               choices=tuple(TASK_RUNNERS))
    # None: picked from the chat template
    reasoning_parser: Optional[str] = _opt(
        None, "split a thinking model's <think> ... </think> from its answer (a server's "
        "message.reasoning); structured outputs and tool calls apply to the answer (default: "
        "the one the chat template implies, if any; none: off)",
        choices=(*REASONING_PARSERS, "none"))
    # structured outputs: caps on a request's constraint, checked before it is compiled (each
    # refusal names its cap), the compile's time limit, one mask's CPU time, the grammar cache
    max_grammar_bytes: int = _so("max_grammar_bytes", "largest constraint a request may send, "
                                 "in UTF-8 bytes (a JSON schema's text, a grammar, a regex, "
                                 "the choices together)")
    max_grammar_rules: int = _so("max_grammar_rules", "most rules in a Lark or GBNF grammar")
    max_json_schema_nodes: int = _so("max_json_schema_nodes", "most objects and arrays in a "
                                     "JSON schema")
    max_guided_choices: int = _so("max_guided_choices", "most strings in a choice constraint "
                                  "(guided_choice)")
    grammar_compile_timeout: float = _so("grammar_compile_timeout", "seconds a constraint may "
                                         "take to compile; a longer one is refused (HTTP 400)")
    max_grammar_mask_ms: float = _so(
        "max_grammar_mask_ms", "CPU milliseconds one request's allowed-token masks (all its n "
        "samples) may take in one step; a request over it is stopped with an error, so that "
        "it cannot slow the others' steps")
    grammar_cache_bytes: int = _so("grammar_cache_bytes", "estimated bytes of compiled "
                                   "grammars kept for reuse")
    # vLLM's: propose tokens cheaply and verify them in one forward pass
    # (docs/speculative_decoding.md)
    speculative_config: Optional[dict[str, Any]] = _opt(
        None, "speculative decoding as a JSON object with vLLM's fields, e.g. '{\"method\": "
        "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
        "\"prompt_lookup_min\": 2}' (n-gram lookup in the prompt, the output and a request's "
        "`prediction`), or '{\"model\": \"DRAFT\", \"num_speculative_tokens\": 4}' (a "
        "smaller model with the same vocabulary drafts; its own \"quantization\" and "
        "\"dtype\") (default: off)",
        type=_json_object, metavar="JSON")
    # LoRA adapters: requests name one with lora_request (docs/lora.md)
    enable_lora: bool = _opt(False, "serve LoRA adapters over the base model: requests may "
                             "name a PEFT or GGUF LoRA adapter (lora_request)", action="store_true",
                             group=_LORA_GROUP)
    max_loras: int = _opt(_LORA.max_loras, "most adapters in one batch (slots on the model; "
                          "the least recently used is evicted)", group=_LORA_GROUP)
    max_lora_rank: int = _opt(_LORA.max_lora_rank, "largest adapter rank (r) accepted",
                              group=_LORA_GROUP)
    max_cpu_loras: Optional[int] = _opt(None, "adapters kept read in memory (default: "
                                        "max_loras)", type=int, group=_LORA_GROUP)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                     names: Optional[Sequence[str]] = None, title: Optional[str] = None,
                     with_ignored: bool = False, honored: frozenset[str] = frozenset()) -> None:
        """Each flag field (or those in `names`) as a flag named after it, in the fields'
        order; `title` lists them in a help group of that name. `with_ignored`: vLLM's options
        that are taken and ignored too, but the `honored` ones (the command has its own)."""
        engine = parser.add_argument_group(title) if title else parser
        groups: dict[tuple[str, str], Any] = {}
        for f in cli_fields(names):
            meta = f.metadata
            group = meta["group"]
            if group is not None and group not in groups:
                groups[group] = parser.add_argument_group(*group)
            target = engine if group is None else groups[group]
            flags = ["--" + f.name.replace("_", "-")] + ([meta["short"]] if meta["short"] else [])
            if meta["action"] is not None:
                kind = dict(action=getattr(argparse, meta["action"], meta["action"]))
            else:
                default_type = str if f.default is None else type(f.default)
                kind = dict(type=meta["type"] or default_type, choices=meta["choices"],
                            metavar=meta["metavar"])
            target.add_argument(*flags, dest=f.name, default=f.default, help=meta["help"], **kind)
        if with_ignored:
            add_ignored_cli_args(parser, exclude=honored)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model: str, *,
                      honored: frozenset[str] = frozenset(), **overrides: Any) -> "EngineArgs":
        """EngineArgs from the flags add_cli_args added (with the same `honored`), `overrides`
        winning; ignored vLLM options warn as LLM() does, a bad value is a ValueError naming
        its field."""
        values = {f.name: getattr(args, f.name) for f in cli_fields() if hasattr(args, f.name)}
        return cls.from_kwargs(model, **{**values, **ignored_cli_values(args, honored),
                                         **overrides})

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
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not a KV cache dtype; "
                             f"the choices are {', '.join(KV_CACHE_DTYPES)}")
        self.hf_overrides = check_hf_overrides(self.hf_overrides)
        # built (and checked: a ValueError naming the field) once; the engine's config takes them
        self._parallel = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                        self.distributed_executor_backend)
        self._structured_outputs = StructuredOutputsConfig(
            **{f.name: getattr(self, f.name) for f in fields(StructuredOutputsConfig)})
        check_parser_name(self.reasoning_parser)
        self._lora = self._lora_config()
        self._speculative = self._speculative_config()
        for name in ("max_num_seqs", "block_size", "max_logprobs"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "num_gpu_blocks_override"):
            check_positive_int(name, getattr(self, name), optional=True)
        gmu = self.gpu_memory_utilization
        if gmu is not None and (isinstance(gmu, bool) or not isinstance(gmu, (int, float))
                                or not 0 < gmu <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        if self.model_source is not None and self.model_source not in MODEL_SOURCES:
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

    def _lora_config(self) -> Optional[LoRAConfig]:
        """The LoRA options checked (a ValueError naming the field), or None without
        enable_lora."""
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        return config if self.enable_lora else None

    def _speculative_config(self) -> Optional[SpeculativeConfig]:
        """speculative_config checked (a ValueError naming the field), or None: off."""
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(self.speculative_config)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise ValueError(f"speculative_config with {name}={getattr(self, name)} is not "
                                 "supported yet: speculative decoding runs on one rank")
        return config

    def speculative(self) -> Optional[SpeculativeConfig]:
        """The speculative decoding asked for (None: off), as checked when these arguments
        were built."""
        return self._speculative

    def lora_config(self) -> Optional[LoRAConfig]:
        """The LoRA options asked for (None: enable_lora is off), as checked when these
        arguments were built."""
        return self._lora

    def parallel_config(self) -> ParallelConfig:
        """The ranks asked for, as checked when these arguments were built."""
        return self._parallel

    def structured_outputs_config(self) -> StructuredOutputsConfig:
        """The structured-output limits asked for, as checked when these arguments were built."""
        return self._structured_outputs
