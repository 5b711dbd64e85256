"""LLMEngine: input processor -> engine core -> output processor, built from EngineArgs."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Optional, Union

from pagedllm.config import EngineConfig, ModelArchConfig
from pagedllm.core.spec_decode import SpecStats
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_builder import make_engine_config
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_outputs import PoolingOutputs
from pagedllm.executor import read_rank_nodes
from pagedllm.loader.checkpoint import generation_config, resolve_checkpoint
from pagedllm.loader.lora_adapter import check_adapter
from pagedllm.lora.registry import AdapterRegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.tokenizer.known_templates import end_of_turn_ids
from pagedllm.hub.sources import locate_model
from pagedllm.tokenizer.tokenizer import load_tokenizer
from pagedllm.tokenizer.vocabulary import check_same_vocabulary
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class LLMEngine:
    """Synchronous engine: add requests, call step() until nothing is left."""

    def __init__(self, config: EngineConfig, tokenizer: Any,
                 gen_config: dict[str, Any]) -> None:
        _check_tokenizer_fits(tokenizer, config)
        self.tokenizer = tokenizer
        self.generation_config = gen_config
        self.eos_token_ids = _eos_ids(config.arch, gen_config, tokenizer,
                                      gguf=config.model_path.endswith(".gguf"))
        self.config = dataclasses.replace(config, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        self.engine_core = EngineCore(self.config)
        logger.info("kernels: %s; decode steps: %s", _kernels_summary(self.config),
                    self.engine_core.executor.decode_path())
        cache = self.config.cache
        self.input_processor = InputProcessor(tokenizer, self.config.scheduler.max_model_len,
                                              config.arch.vocab_size, frozenset(self.eos_token_ids),
                                              cache.block_size, config.max_logprobs,
                                              config.structured_outputs,
                                              config.arch if config.is_pooling else None,
                                              config.speculative is not None)
        self.output_processor = OutputProcessor(tokenizer)
        self.adapters = AdapterRegistry(config.arch, config.lora, check_adapter)
        self.pooling_outputs = PoolingOutputs()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Find the checkpoint, size the engine, load the weights."""
        located = locate_model(args.model, args.revision, args.gguf_file, args.model_source)
        spec = args.speculative()
        drafted = None if spec is None or not spec.uses_draft_model else locate_model(
            spec.model, spec.revision, None, args.model_source)
        # plan memory on metadata before any weight byte is downloaded (fit before fetch)
        meta = resolve_checkpoint(located.metadata_path, args.hf_overrides)
        draft_meta = None if drafted is None else resolve_checkpoint(drafted.metadata_path)
        config = make_engine_config(args, meta, read_rank_nodes, draft_meta)
        ckpt = meta if located.fetch is None else resolve_checkpoint(located.weights_path(),
                                                                     args.hf_overrides)
        config = dataclasses.replace(config, model_path=str(ckpt.path))
        tokenizer = load_tokenizer(args.tokenizer or ckpt.tokenizer_path,
                                   trust_remote_code=args.trust_remote_code,
                                   max_tokens=config.arch.vocab_size)
        if drafted is not None:
            draft = draft_meta if drafted.fetch is None else resolve_checkpoint(
                drafted.weights_path())
            check_same_vocabulary(tokenizer, load_tokenizer(
                draft.tokenizer_path, trust_remote_code=args.trust_remote_code,
                max_tokens=draft.arch.vocab_size), args.model, spec.model)
            config = dataclasses.replace(config, draft=dataclasses.replace(
                config.draft, model_path=str(draft.path)))
        config = dataclasses.replace(config, arch=_classifier_token_ids(config.arch, tokenizer))
        return cls(config, tokenizer, generation_config(ckpt))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """Validate, tokenize and queue a request (n samples become n sequences), run with a
        LoRA adapter when lora_request names one (enable_lora)."""
        lora_request = self.adapters.check(lora_request)
        self.add_processed(request_id, self.input_processor.process(
            request_id, prompt, params, lora_request=lora_request))

    def add_pooling_request(self, request_id: str, prompt: PromptType,
                            params: Optional[PoolingParams] = None) -> None:
        """Validate, tokenize and queue a pooling request (a pooling model only)."""
        self.add_processed(request_id,
                           self.input_processor.process_pooling(request_id, prompt, params))

    def add_processed(self, request_id: str, processed: ProcessedPrompt) -> None:
        """Queue a prompt already validated by input_processor (e.g. on another thread)."""
        if processed.requests[0].pooling_params is not None:
            self.pooling_outputs.add(request_id, processed.prompt, processed.prompt_token_ids)
            self.engine_core.add_request(processed.requests[0])
            return
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids,
            [(r.request_id, r.sampling_params) for r in processed.requests])
        for request in processed.requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stop requests and free their KV blocks at once."""
        for request_id in list(request_ids):
            if self.pooling_outputs.owns(request_id):
                self.pooling_outputs.abort(request_id)
                self.engine_core.abort_requests([request_id])
                continue
            self.engine_core.abort_requests(self.output_processor.child_ids(request_id))
            self.output_processor.abort(request_id)

    @property
    def num_running(self) -> int:
        """Sequences being computed."""
        return len(self.engine_core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued or preempted."""
        return self.engine_core.scheduler.num_waiting

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapters (names, sorted) of the running and of the waiting requests; read
        from any thread (copies of the queues, taken at once)."""
        scheduler = self.engine_core.scheduler

        def names(requests: list) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in requests
                                 if r.lora_request is not None}))
        return names(list(scheduler.running)), names(list(scheduler.waiting))

    def has_unfinished_requests(self) -> bool:
        """Any request still producing."""
        return (self.engine_core.has_unfinished_requests() or self.output_processor.has_unfinished()
                or self.pooling_outputs.has_unfinished())

    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """One forward pass; RequestOutputs of the requests that progressed, and a
        PoolingRequestOutput for each pooling request finished."""
        core_outputs = self.engine_core.step()
        pooled = [self.pooling_outputs.finish(o) for o in core_outputs
                  if self.pooling_outputs.owns(o.req_id)]
        if pooled:
            done = {p.request_id for p in pooled}
            core_outputs = [o for o in core_outputs if o.req_id not in done]
        outputs, to_abort = self.output_processor.process(core_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs + pooled

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (as vLLM does)."""
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return SamplingParams(**{k: self.generation_config[k] for k in keys
                                 if self.generation_config.get(k) is not None})

    @property
    def vocab_size(self) -> int:
        """Size of the model's vocabulary: valid token ids are [0, vocab_size)."""
        return self.config.arch.vocab_size

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run a Worker method on every rank (one in one process); the answers in rank order."""
        return self.engine_core.executor.collective_rpc(method, *args)

    @property
    def max_batches_in_flight(self) -> int:
        """The most batches seen in flight at once (pipeline parallelism's batch queue); at
        least 1 once a step ran."""
        return max(1, self.engine_core.max_batches_in_flight)

    def rank_comm_stats(self, reset: bool = False) -> Optional[list[dict]]:
        """Each rank's stage send/recv and tensor parallel collective counters
        (Worker.comm_stats), in rank order, or None in one process (nothing is sent)."""
        parallel = self.config.parallel
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1:
            return None
        return self.collective_rpc("comm_stats", reset)

    def shutdown(self) -> None:
        """Stop the workers (worker processes, with several ranks); the engine is unusable
        after."""
        self.engine_core.shutdown()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use (0-1)."""
        return self.engine_core.kv_manager.usage

    def spec_stats(self) -> Optional[SpecStats]:
        """Speculative decoding's counts since start (a snapshot), or None when it is off."""
        speculator = self.engine_core.scheduler.speculator
        return None if speculator is None else speculator.stats.copy()


def _kernels_summary(config: EngineConfig) -> str:
    """Which code runs the model (after the worker loaded it): ops, attention, matmuls."""
    platform, dtype = config.platform, config.dtype
    ops = "pagedllm's compiled ops" if platform.op_impl(dtype) != "native" else "PyTorch ops"
    matmuls = {"gguf": "matmuls on the GGUF's quantized blocks",
               "int8": "int8 weight-only matmuls",
               "int8_g128": "int8 weight-only matmuls, a scale per 128 values",
               "int4": "int4 weight-only matmuls",
               "bf16": "pagedllm's bf16 weight-only matmuls (float32 activations)"}.get(
        config.quantization, f"{str(dtype).removeprefix('torch.')} matmuls")
    summary = f"{ops}, {platform.attention_backend(dtype)} attention, {matmuls}"
    if platform.kernels_error is not None:
        summary += f" (pagedllm's CPU kernels could not be built: {platform.kernels_error})"
    return summary


def _eos_ids(arch: ModelArchConfig, gen_cfg: dict, tokenizer, *, gguf: bool) -> set[int]:
    """Token ids that end a sequence: the checkpoint's eos (GGUF: eos, eot, eom keys) and its
    generation_config's, else the tokenizer's eos; for a GGUF also the end-of-turn tokens of
    its vocabulary, on which llama.cpp stops whether or not the file names them (Gemma's
    <end_of_turn>)."""
    ids = set(arch.eos_token_ids)
    extra = gen_cfg.get("eos_token_id")
    ids.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    if gguf:
        ids.update(end_of_turn_ids(tokenizer))
    return ids


def _classifier_token_ids(arch: ModelArchConfig, tokenizer: Any) -> ModelArchConfig:
    """arch with its classifier's from_tokens (classifier_from_token) as the tokenizer's ids,
    which the ranks need to build the head from the LM head's rows; a token the vocabulary
    lacks is a ValueError naming it."""
    head = arch.classifier
    if head is None or not head.from_tokens:
        return arch
    ids = []
    for token in head.from_tokens:
        index = tokenizer.convert_tokens_to_ids(token)
        if index is None or tokenizer.convert_ids_to_tokens(index) != token:
            raise ValueError(f"classifier_from_token {token!r} is not a token of the model's "
                             "vocabulary")
        ids.append(index)
    return dataclasses.replace(arch, classifier=dataclasses.replace(head, token_ids=tuple(ids)))


def _check_tokenizer_fits(tokenizer: Any, config: EngineConfig) -> None:
    """Refuse, before any weight is loaded, a tokenizer with ids the model has no embedding for
    (e.g. another model's tokenizer.json beside a GGUF)."""
    size = len(tokenizer)
    if size > config.arch.vocab_size:
        raise ValueError(
            f"the tokenizer has {size} tokens but the model's embedding has "
            f"{config.arch.vocab_size} rows ({config.model_path}): they belong to different "
            "models; pass the model's own tokenizer with tokenizer=...")
