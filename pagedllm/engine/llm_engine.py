"""LLMEngine: builds the engine from EngineArgs and turns steps into RequestOutputs."""
from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from pagedllm.config import EngineConfig, ModelArchConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_builder import make_engine_config
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.kernels import kernels_available, load_kernels
from pagedllm.layers.ggml_linear import KERNEL_TYPES, pack_x8
from pagedllm.layers.quantization import quantize_float_model
from pagedllm.loader.gguf_loader import gguf_quant_plan
from pagedllm.loader.checkpoint import Checkpoint, generation_config, load_weights, resolve_checkpoint
from pagedllm.loader.sources import locate_model
from pagedllm.loader.tokenizer import load_tokenizer
from pagedllm.models.fused_decode import enable_fused_decode
from pagedllm.models.registry import build_model
from pagedllm.outputs import RequestOutput
from pagedllm.platforms import cpu_platform
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner, allocate_kv_cache

logger = logging.getLogger("pagedllm")

class LLMEngine:
    """Synchronous engine: add requests, call step() until nothing is left."""

    def __init__(self, config: EngineConfig, ckpt: Checkpoint, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        arch, device = config.arch, torch.device(config.device)
        torch.manual_seed(config.seed)
        if device.type == "cpu":
            cpu_platform().apply_threads()
        started = time.monotonic()
        quant = config.quantization
        if quant != "none":
            load_kernels()
        elif device.type == "cpu":
            kernels_available()  # fused CPU ops; the model falls back to plain PyTorch without
        plan = gguf_quant_plan(ckpt.path, KERNEL_TYPES) if quant == "gguf" else None
        model = build_model(arch, config.scheduler.max_model_len, config.dtype, device, plan)
        with torch.no_grad():
            load_weights(ckpt, dict(model.named_parameters()))
        if quant in ("int8", "int4"):
            quantize_float_model(model, quant)
        if quant != "none" and device.type == "cpu":
            pack_x8(model)  # the eight-row layout of the CPU kernels
            enable_fused_decode(model)
        logger.info("loaded %s (%s, %s, quantization %s) in %.1f s", ckpt.path,
                    arch.architecture, config.dtype, quant, time.monotonic() - started)
        self.generation_config = generation_config(ckpt)
        self.eos_token_ids = _eos_ids(arch, self.generation_config, tokenizer)
        cache = config.cache
        kv = allocate_kv_cache(arch.num_hidden_layers, cache.num_blocks, cache.block_size,
                               arch.num_key_value_heads, arch.head_dim, config.dtype, device)
        self.kv_manager = KVCacheManager(cache.num_blocks, cache.block_size,
                                         cache.enable_prefix_caching)
        runner = ModelRunner(model, kv, cache.block_size, sorted(self.eos_token_ids), device)
        self.core = EngineCore(Scheduler(config.scheduler, self.kv_manager), runner)
        self.input_processor = InputProcessor(tokenizer, config.scheduler.max_model_len,
                                              arch.vocab_size, frozenset(self.eos_token_ids),
                                              cache.block_size, config.max_logprobs)
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Find the checkpoint, size the engine, load the weights."""
        located = locate_model(args.model, args.revision, args.gguf_file, args.model_source)
        # plan memory on metadata before any weight byte is downloaded (fit before fetch)
        meta = resolve_checkpoint(located.metadata_path)
        config = make_engine_config(args, meta)
        ckpt = meta if located.fetch is None else resolve_checkpoint(located.weights_path())
        tokenizer = load_tokenizer(args.tokenizer or ckpt.tokenizer_path,
                                   trust_remote_code=args.trust_remote_code)
        return cls(config, ckpt, tokenizer)

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model."""
        return self.core.runner.model

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Validate, tokenize and queue a request (n samples become n sequences)."""
        self.add_processed(request_id, self.input_processor.process(request_id, prompt, params))

    def add_processed(self, request_id: str, processed: ProcessedPrompt) -> None:
        """Queue a prompt already validated by input_processor (e.g. on another thread)."""
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids,
            [(r.request_id, r.sampling_params) for r in processed.requests])
        for request in processed.requests:
            self.core.add_request(request)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stop requests and free their KV blocks at once."""
        for request_id in list(request_ids):
            self.core.abort_requests(self.output_processor.child_ids(request_id))
            self.output_processor.abort(request_id)

    @property
    def num_running(self) -> int:
        """Sequences being computed."""
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued or preempted."""
        return self.core.scheduler.num_waiting

    def has_unfinished_requests(self) -> bool:
        """Any request still producing."""
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One forward pass; RequestOutputs of the requests that progressed."""
        outputs, to_abort = self.output_processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (as vLLM does)."""
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return SamplingParams(**{k: self.generation_config[k] for k in keys
                                 if self.generation_config.get(k) is not None})

    @property
    def vocab_size(self) -> int:
        """Size of the model's vocabulary: valid token ids are [0, vocab_size)."""
        return self.config.arch.vocab_size

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use (0-1)."""
        return self.kv_manager.usage


def _eos_ids(arch: ModelArchConfig, gen_cfg: dict, tokenizer) -> set[int]:
    ids = set(arch.eos_token_ids)
    extra = gen_cfg.get("eos_token_id")
    ids.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids



